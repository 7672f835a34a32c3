use super::*;
use proptest::prelude::*;

fn file(entries: &[(&str, &str, &[&str])]) -> String {
    entries
        .iter()
        .map(|(name, token, scopes)| {
            format!(
                "[[token]]\nname = {name:?}\nsha256 = \"{}\"\nscopes = {:?}\n",
                sha256_hex(token),
                scopes
            )
        })
        .collect()
}

#[test]
fn scopes_imply_as_documented() {
    use Scope::*;
    let yes = [
        (Read, Read),
        (Submit, Read),
        (Submit, Submit),
        (Admin, Read),
        (Admin, Submit),
        (Admin, Admin),
        (Metrics, Metrics),
    ];
    for a in Scope::ALL {
        for b in Scope::ALL {
            assert_eq!(a.grants(b), yes.contains(&(a, b)), "{a} grants {b}");
        }
    }
}

#[test]
fn known_digest_of_a_token() {
    // printf %s secret | sha256sum
    assert_eq!(
        sha256_hex("secret"),
        "2bb80d537b1da3e38bd30361aa855686bde0eacd7162fef6a25fe97bf527a25b"
    );
}

#[test]
fn lookup_finds_the_entry_of_the_token() {
    let t = TokenTable::parse(&file(&[
        ("alice", "a-token", &["read", "submit"]),
        ("ops", "o-token", &["admin"]),
    ]))
    .unwrap();
    assert_eq!(t.lookup("a-token").unwrap().name, "alice");
    assert_eq!(t.lookup("o-token").unwrap().name, "ops");
    assert!(t.lookup("a-toke").is_none());
    assert!(t.lookup("").is_none());
    let p = t.authenticate(Some(b"Bearer o-token")).unwrap();
    assert!(p.has(Scope::Submit) && !p.has(Scope::Metrics));
    assert_eq!(
        t.authenticate(Some(b"bearer  a-token ")).unwrap().name,
        "alice"
    );
}

#[test]
fn headers_that_are_not_a_bearer_token() {
    let t = TokenTable::parse(&file(&[("a", "tok", &["read"])])).unwrap();
    assert_eq!(t.authenticate(None), Err(AuthError::Missing));
    for bad in [
        &b"tok"[..],
        b"Basic dG9rOg==",
        b"Bearer ",
        b"Bearer tok en",
        b"Bearer \xff\xfe",
    ] {
        let e = t.authenticate(Some(bad)).unwrap_err();
        assert!(
            matches!(e, AuthError::Malformed(_)),
            "{:?}: {e:?}",
            String::from_utf8_lossy(bad)
        );
        assert!(e.unauthenticated());
    }
    let long = format!("Bearer {}", "x".repeat(MAX_TOKEN + 1));
    assert!(matches!(
        t.authenticate(Some(long.as_bytes())),
        Err(AuthError::Malformed(m)) if m.contains("4096")
    ));
    assert_eq!(
        t.authenticate(Some(b"Bearer other")),
        Err(AuthError::UnknownToken)
    );
}

#[test]
fn bad_files_name_the_entry_and_what_is_allowed() {
    let digest = sha256_hex("x");
    let cases = [
        (
            format!("[[token]]\nname = \"a\"\nsha256 = \"{digest}\"\nscopes = [\"write\"]\n"),
            "token[0] (name \"a\"): unknown scope \"write\"; allowed: read, submit, admin, metrics",
        ),
        (
            "[[token]]\nname = \"a\"\nsha256 = \"abc\"\nscopes = [\"read\"]\n".to_string(),
            "sha256 = \"abc\" must be 64 hex digits",
        ),
        (
            format!("[[token]]\nname = \"\"\nsha256 = \"{digest}\"\nscopes = [\"read\"]\n"),
            "name must be 1 to 64 characters",
        ),
        (
            format!("[[token]]\nname = \"a\"\nsha256 = \"{digest}\"\nscopes = []\n"),
            "scopes is empty",
        ),
        (
            format!("[[token]]\nname = \"a\"\nsha256 = \"{digest}\"\nscopes = [\"read\"]\ncolour = 1\n"),
            "unknown field `colour`",
        ),
        (
            format!("[[token]]\nname = \"a\"\nsha256 = \"{digest}\"\nscopes = [\"read\"]\n[[token]]\nname = \"b\"\nsha256 = \"{}\"\nscopes = [\"read\"]\n", digest.to_uppercase()),
            "token[1] (name \"b\"): the same sha256 as token[0] (name \"a\")",
        ),
    ];
    for (text, want) in cases {
        let e = TokenTable::parse(&text).unwrap_err();
        assert!(e.contains(want), "{e:?} lacks {want:?}");
    }
    assert!(TokenTable::parse("").unwrap().is_empty());
}

#[test]
fn grpc_methods_and_http_routes_need_their_scopes() {
    use Rule::*;
    let j = |m: &str| grpc_rule(&format!("{JOB_SERVICE}{m}"));
    assert_eq!(j("GetJob"), Need(Scope::Read));
    assert_eq!(j("ListJobs"), Need(Scope::Read));
    assert_eq!(j("WatchJob"), Need(Scope::Read));
    assert_eq!(j("SubmitJob"), Need(Scope::Submit));
    assert_eq!(j("CancelJob"), Need(Scope::Submit));
    assert_eq!(j("ResumeJob"), Need(Scope::Submit));
    assert_eq!(j("DeleteEverything"), Need(Scope::Admin));
    assert_eq!(grpc_rule("/grpc.reflection.v1.X/Y"), Need(Scope::Admin));
    assert_eq!(grpc_rule("/accrue.v1.WorkerService/Attach"), Open);
    use axum::http::Method;
    assert_eq!(http_rule(&Method::GET, "/healthz"), Open);
    assert_eq!(http_rule(&Method::GET, "/readyz"), Open);
    assert_eq!(http_rule(&Method::GET, "/metrics"), Need(Scope::Metrics));
    assert_eq!(http_rule(&Method::GET, "/"), Open);
    assert_eq!(http_rule(&Method::GET, "/assets/app.js"), Open);
    assert_eq!(
        http_rule(&Method::POST, "/assets/app.js"),
        Need(Scope::Submit)
    );
    for p in [
        "/v1/jobs",
        "/v1/jobs/a-1",
        "/v1/jobs/a-1/series",
        "/v1/jobs/a-1/events",
        "/v1/workers",
        "/v1/whoami",
        "/nothing",
    ] {
        assert_eq!(http_rule(&Method::GET, p), Need(Scope::Read), "{p}");
    }
    for action in ["cancel", "resume"] {
        assert_eq!(
            http_rule(&Method::POST, &format!("/v1/jobs/a-1/{action}")),
            Need(Scope::Submit),
            "{action}"
        );
    }
    // The sign-in POST is open (its code is the credential); nothing else
    // under that name is.
    assert_eq!(http_rule(&Method::POST, "/v1/signin"), Open);
    assert_eq!(http_rule(&Method::GET, "/v1/signin"), Need(Scope::Read));
    assert_eq!(
        http_rule(&Method::POST, "/v1/signin/x"),
        Need(Scope::Submit)
    );
}

#[test]
fn sign_in_codes_stand_for_a_reading_token_once() {
    let d = tempfile::tempdir().unwrap();
    let path = d.path().join("tokens.toml");
    let f = file(&[("s", "st", &["read", "submit"]), ("m", "mt", &["metrics"])]);
    std::fs::write(&path, f).unwrap();
    let t = Tokens::load(&path).unwrap();
    let code = t.sign_in_code("st").unwrap();
    let (token, p) = t.redeem_sign_in(&code).unwrap();
    assert_eq!((token.as_str(), p.name.as_str()), ("st", "s"));
    assert_eq!(p.scopes, [Scope::Read, Scope::Submit]);
    assert_eq!(t.redeem_sign_in(&code), None, "a second use");
    // Only for a token of the file that may read.
    assert_eq!(t.sign_in_code("nope"), Err(AuthError::UnknownToken));
    assert!(matches!(
        t.sign_in_code("mt"),
        Err(AuthError::Forbidden {
            need: Scope::Read,
            ..
        })
    ));
}

#[test]
fn decide_refuses_with_the_right_kind() {
    let t = TokenTable::parse(&file(&[("r", "rt", &["read"]), ("m", "mt", &["metrics"])])).unwrap();
    let need = Rule::Need(Scope::Submit);
    // Auth off, or an open rule: nothing needed.
    assert_eq!(decide(None, need, None, "x"), Ok(None));
    assert_eq!(decide(Some(&t), Rule::Open, None, "x"), Ok(None));
    assert_eq!(decide(Some(&t), need, None, "x"), Err(AuthError::Missing));
    let e = decide(Some(&t), need, Some(b"Bearer rt"), "SubmitJob").unwrap_err();
    assert!(!e.unauthenticated());
    assert_eq!(
        e.to_string(),
        "r lacks the submit scope (has: read) needed for SubmitJob"
    );
    let s: tonic::Status = e.into();
    assert_eq!(s.code(), tonic::Code::PermissionDenied);
    let s: tonic::Status = AuthError::UnknownToken.into();
    assert_eq!(s.code(), tonic::Code::Unauthenticated);
    // metrics does not read.
    assert!(decide(Some(&t), Rule::Need(Scope::Read), Some(b"Bearer mt"), "x").is_err());
    assert_eq!(
        decide(Some(&t), Rule::Need(Scope::Read), Some(b"Bearer rt"), "x")
            .unwrap()
            .unwrap()
            .name,
        "r"
    );
}

#[test]
fn the_file_reloads_when_it_changes_and_a_bad_version_keeps_the_old() {
    let dir = tempfile::tempdir().unwrap();
    let path = dir.path().join("tokens.toml");
    std::fs::write(
        &path,
        file(&[("a", "ta", &["read"]), ("b", "tb", &["read"])]),
    )
    .unwrap();
    let tokens = Tokens::load(&path).unwrap();
    let t0 = Instant::now();
    assert!(tokens.current_at(t0).lookup("tb").is_some());
    // Replaced by a file without b (renamed over, so a new inode).
    let next = dir.path().join("next.toml");
    std::fs::write(&next, file(&[("a", "ta", &["read"])])).unwrap();
    std::fs::rename(&next, &path).unwrap();
    // Not looked at again within a second...
    assert!(tokens.current_at(t0).lookup("tb").is_some());
    // ...then re-read.
    let t1 = t0 + RELOAD_EVERY;
    assert!(tokens.current_at(t1).lookup("tb").is_none());
    assert!(tokens.current_at(t1).lookup("ta").is_some());
    // A broken version keeps the last good table.
    std::fs::write(&path, "[[token]]\nname = 1\n").unwrap();
    let t2 = t1 + RELOAD_EVERY;
    assert!(tokens.current_at(t2).lookup("ta").is_some());
    // So does a missing file.
    std::fs::remove_file(&path).unwrap();
    assert!(tokens.current_at(t2 + RELOAD_EVERY).lookup("ta").is_some());
    // And it comes back.
    std::fs::write(&path, file(&[("c", "tc", &["admin"])])).unwrap();
    let t = tokens.current_at(t2 + 2 * RELOAD_EVERY);
    assert!(t.lookup("ta").is_none() && t.lookup("tc").is_some());
    assert!(matches!(
        Tokens::load(&dir.path().join("absent.toml")),
        Err(TokensError::Read { .. })
    ));
}

proptest! {
    #[test]
    fn any_header_bytes_are_refused_or_a_known_token(bytes in proptest::collection::vec(any::<u8>(), 0..200)) {
        let t = TokenTable::parse(&file(&[("a", "tok", &["read"])])).unwrap();
        match t.authenticate(Some(&bytes)) {
            Ok(p) => prop_assert_eq!(p.name, "a"),
            Err(e) => prop_assert!(e.unauthenticated()),
        }
    }

    #[test]
    fn only_the_exact_token_matches(token in "[!-~]{1,40}", other in "[!-~]{1,40}") {
        let t = TokenTable::parse(&file(&[("a", &token, &["read"])])).unwrap();
        prop_assert!(t.lookup(&token).is_some());
        prop_assert_eq!(t.lookup(&other).is_some(), other == token);
    }
}
