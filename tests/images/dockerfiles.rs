//! The Dockerfiles as text: pinned bases, a non-root user, the same script.

use super::*;

/// The FROM lines of a Dockerfile: (image, stage name).
fn stages(dockerfile: &str) -> Vec<(String, Option<String>)> {
    dockerfile
        .lines()
        .map(str::trim)
        .filter(|l| l.len() > 5 && l[..5].eq_ignore_ascii_case("FROM "))
        .map(|l| {
            let words: Vec<&str> = l[5..]
                .split_whitespace()
                .filter(|w| !w.starts_with("--"))
                .collect();
            let name = (words.len() == 3 && words[1].eq_ignore_ascii_case("AS"))
                .then(|| words[2].to_string());
            (words[0].to_string(), name)
        })
        .collect()
}

#[test]
fn dockerfiles_pin_their_bases_run_as_nonroot_and_use_the_script() {
    let dir = repo().join("deploy/images");
    for (file, script_call, torch) in [
        (
            "Dockerfile.cpu",
            "deploy/images/assemble-runtime.sh /runtime",
            "--index-url https://download.pytorch.org/whl/cpu torch==2.11.0+cpu",
        ),
        (
            "Dockerfile.cuda",
            "deploy/images/assemble-runtime.sh --cuda /runtime",
            "torch==2.11.0",
        ),
    ] {
        let df = std::fs::read_to_string(dir.join(file)).unwrap();
        let stages = stages(&df);
        assert!(stages.len() >= 2, "{file}: not multi-stage: {stages:?}");
        let mut names = Vec::new();
        for (image, name) in &stages {
            assert!(
                !image.contains('$'),
                "{file}: FROM {image}: a variable base"
            );
            if image != "scratch" && !names.contains(image) {
                let last = image.rsplit('/').next().unwrap();
                let tag = last.split_once(':').map(|(_, t)| t);
                assert!(
                    image.contains("@sha256:") || tag.is_some_and(|t| t != "latest"),
                    "{file}: FROM {image} is not pinned by tag"
                );
            }
            names.extend(name.clone());
        }
        // The runtime stage: the tree, a non-root user, no shell needed.
        let runtime = df.rsplit_once("\nFROM ").unwrap().1;
        assert!(
            runtime.contains("COPY --from=builder /runtime /"),
            "{file}: the runtime stage does not copy the tree"
        );
        let user = runtime
            .lines()
            .rfind(|l| l.starts_with("USER "))
            .unwrap_or_else(|| panic!("{file}: no USER in the runtime stage"));
        let uid = user[5..].trim().split(':').next().unwrap();
        assert!(
            uid.parse::<u32>().is_ok_and(|u| u != 0),
            "{file}: {user}: not a numeric non-root user"
        );
        assert!(
            !runtime.lines().any(|l| l.starts_with("RUN ")),
            "{file}: the runtime stage runs commands, but has no shell"
        );
        assert!(runtime.contains("ENV PATH=/usr/local/bin"), "{file}");
        for label in [
            "org.opencontainers.image.title",
            "org.opencontainers.image.version",
            "org.opencontainers.image.licenses",
            "org.opencontainers.image.source",
        ] {
            assert!(runtime.contains(label), "{file}: no label {label}");
        }
        // The builder: the same script, the pinned libtorch, a locked build.
        assert!(
            df.contains(script_call),
            "{file} does not run {script_call}"
        );
        assert!(df.contains(torch), "{file} does not install {torch}");
        assert!(
            df.contains(
                "cargo build --release --locked -p accrue -p accrue-coordinator -p accrue-worker"
            ),
            "{file}"
        );
        for bin in BINS {
            assert!(
                df.contains(&format!("target/release/{bin}")),
                "{file}: {bin}"
            );
        }
        assert_eq!(
            df.contains("ENV ACCRUE_CUDA=1"),
            file == "Dockerfile.cuda",
            "{file}: ACCRUE_CUDA"
        );
    }
    let ignore = std::fs::read_to_string(repo().join(".dockerignore")).unwrap();
    for entry in ["target", "runs", ".venv", ".libtorch", "data"] {
        assert!(
            ignore.lines().any(|l| l.trim() == entry),
            ".dockerignore does not exclude {entry}"
        );
    }
}
