//! Every overlay renders and validates strictly against Kubernetes' schemas.

use super::*;

#[test]
fn every_overlay_renders_and_validates_strictly() {
    let f = fixture();
    for r in &f.renders {
        let n = validate(&r.file).unwrap_or_else(|e| panic!("{}: {e}", r.name));
        let objects = kinds(&std::fs::read_to_string(&r.file).unwrap());
        eprintln!(
            "{}: {} objects, {n} validated against {KUBERNETES_VERSION}",
            r.name,
            objects.len()
        );
        for want in ["StatefulSet", "Deployment", "NetworkPolicy", "Secret"] {
            assert!(objects.iter().any(|k| k == want), "{}: no {want}", r.name);
        }
        if r.name.ends_with("components") {
            for want in CUSTOM_KINDS {
                assert!(objects.iter().any(|k| k == want), "{}: no {want}", r.name);
            }
        }
    }
    validate(&f.example()).unwrap();
}

#[test]
fn strict_validation_refuses_an_unknown_field() {
    let f = fixture();
    let out = mutated(f, "cpu", &["unknown-field"]);
    let err = validate(&out.join("unknown-field.yaml")).unwrap_err();
    assert!(
        err.contains("did not validate") && err.contains("imagePullPolicyy"),
        "{err}"
    );
}
