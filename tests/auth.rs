//! Bearer tokens with scopes, against a coordinator process started here
//! with `--tokens` (loopback): JobService refusals by kind, job owners and
//! who may cancel, the tokens file reloading without a restart, the HTTP
//! guard (probes open, 401/403, security headers, the cancel POST) and the
//! dashboard rendering stored text as text. The CLI's --token,
//! --token-file and ACCRUE_TOKEN run as processes too.

mod common;

use accrue::{connect_client, BearerToken, Client};
use accrue_proto::v1::{self, JobState};
use common::*;
use std::path::{Path, PathBuf};
use std::process::{Command, Output};
use std::time::Duration;
use tempfile::TempDir;
use tonic::Code;

const ALICE: &str = "alice-7f3c9a2e";
const BOB: &str = "bob-51d0e8b4";
const READER: &str = "reader-0a9b8c7d";
const OPS: &str = "ops-c4d5e6f7";
const SCRAPER: &str = "scraper-11223344";
const MARKUP: &str = "markup-99887766";
/// A principal whose name is markup: it must show as text.
const MARKUP_NAME: &str = r#"<b id="x">mal</b>&'"#;

fn everyone() -> String {
    tokens_toml(&[
        ("alice", ALICE, &["read", "submit"]),
        ("bob", BOB, &["submit"]),
        ("reader", READER, &["read"]),
        ("ops", OPS, &["admin"]),
        ("scraper", SCRAPER, &["metrics"]),
        (MARKUP_NAME, MARKUP, &["submit"]),
    ])
}

/// Replaces the file in one step (a rename), as an operator should.
fn replace(path: &Path, text: &str) {
    let tmp = path.with_extension("new");
    std::fs::write(&tmp, text).unwrap();
    std::fs::rename(&tmp, path).unwrap();
}

struct Setup {
    dir: TempDir,
    tokens: PathBuf,
    coord: CoordinatorProc,
}

fn start() -> Setup {
    let dir = TempDir::new().unwrap();
    let tokens = write(dir.path(), "tokens.toml", &everyone());
    let mut args: Vec<String> = [
        "--listen",
        "127.0.0.1:0",
        "--http",
        "127.0.0.1:0",
        "--state-dir",
        &dir.path().join("state").display().to_string(),
        "--tokens",
        &tokens.display().to_string(),
    ]
    .iter()
    .map(|s| s.to_string())
    .collect();
    args.extend(creds().tls_args());
    let coord = spawn_coordinator(&args, &dir.path().join("coordinator.log"));
    Setup { dir, tokens, coord }
}

async fn as_(grpc: &str, token: Option<&str>) -> Client {
    let t = token.map_or_else(BearerToken::default, |t| BearerToken::new(t).unwrap());
    connect_client(grpc, Some(&creds().client_tls()), &t)
        .await
        .unwrap()
}

fn job_spec(name: &str) -> v1::JobSpec {
    spec(&job_toml(name, 1, 5, ""))
}

async fn submit(c: &mut Client, name: &str) -> Result<v1::Job, tonic::Status> {
    c.submit_job(v1::SubmitJobRequest {
        spec: Some(job_spec(name)),
        ..Default::default()
    })
    .await
    .map(|r| r.into_inner())
}

async fn cancel(c: &mut Client, id: &str) -> Result<v1::Job, tonic::Status> {
    c.cancel_job(v1::CancelJobRequest { id: id.into() })
        .await
        .map(|r| r.into_inner())
}

async fn list(c: &mut Client) -> Result<Vec<v1::Job>, tonic::Status> {
    c.list_jobs(v1::ListJobsRequest::default())
        .await
        .map(|r| r.into_inner().jobs)
}

#[track_caller]
fn code<T: std::fmt::Debug>(r: Result<T, tonic::Status>) -> (Code, String) {
    let s = r.unwrap_err();
    (s.code(), s.message().to_string())
}

/// `accrue --coordinator <grpc> <args>` over TLS with `env` (and no token
/// from the test's own environment).
fn accrue(grpc: &str, env: &[(&str, &str)], args: &[&str]) -> Output {
    let mut c = Command::new(env!("CARGO_BIN_EXE_accrue"));
    c.env_remove("ACCRUE_TOKEN").env_remove("ACCRUE_TOKEN_FILE");
    c.env("ACCRUE_CA", creds().ca());
    c.envs(env.iter().copied());
    c.args(["--coordinator", grpc]).args(args).output().unwrap()
}

#[tokio::test]
async fn job_service_refuses_by_kind_and_records_the_owner() {
    let s = start();
    let g = s.coord.grpc.as_str();

    // No token, a malformed header, an unknown token: UNAUTHENTICATED.
    let (c, m) = code(list(&mut as_(g, None).await).await);
    assert_eq!(c, Code::Unauthenticated, "{m}");
    assert!(m.contains("Bearer"), "{m}");
    let mut raw = accrue::connect_with(g, Some(&creds().client_tls()))
        .await
        .unwrap();
    for bad in ["Basic YWxpY2U6eA==", "Bearer", "Token x", ALICE] {
        let mut req = tonic::Request::new(v1::ListJobsRequest::default());
        req.metadata_mut()
            .insert("authorization", bad.parse().unwrap());
        let (c, m) = code(raw.list_jobs(req).await);
        assert_eq!(c, Code::Unauthenticated, "{bad:?}: {m}");
        assert!(m.contains("malformed"), "{bad:?}: {m}");
    }
    let (c, m) = code(list(&mut as_(g, Some("not-a-token")).await).await);
    assert_eq!(
        (c, m.contains("unknown token")),
        (Code::Unauthenticated, true),
        "{m}"
    );

    // A read token cannot submit; a metrics token cannot read.
    let (c, m) = code(submit(&mut as_(g, Some(READER)).await, "r").await);
    assert_eq!(c, Code::PermissionDenied, "{m}");
    assert!(m.contains("reader lacks the submit scope"), "{m}");
    let (c, _) = code(list(&mut as_(g, Some(SCRAPER)).await).await);
    assert_eq!(c, Code::PermissionDenied);
    assert!(list(&mut as_(g, Some(READER)).await)
        .await
        .unwrap()
        .is_empty());

    // The submitter is the owner.
    let mut alice = as_(g, Some(ALICE)).await;
    let mut bob = as_(g, Some(BOB)).await;
    let a1 = submit(&mut alice, "a").await.unwrap();
    assert_eq!(a1.owner, "alice");
    let got = alice
        .get_job(v1::GetJobRequest { id: a1.id.clone() })
        .await
        .unwrap()
        .into_inner();
    assert_eq!(got.owner, "alice");

    // submit implies read; metrics does not.
    let b1 = submit(&mut bob, "b").await.unwrap();
    assert_eq!(b1.owner, "bob");
    assert_eq!(list(&mut bob).await.unwrap().len(), 2);
    let w = as_(g, Some(SCRAPER))
        .await
        .watch_job(v1::WatchJobRequest { id: b1.id.clone() })
        .await;
    assert_eq!(code(w).0, Code::PermissionDenied);

    // Another owner's job: PERMISSION_DENIED and nothing changes; one's own:
    // cancelled; admin cancels anyone's.
    let (c, m) = code(cancel(&mut bob, &a1.id).await);
    assert_eq!(c, Code::PermissionDenied, "{m}");
    assert!(m.contains("owned by alice"), "{m}");
    let now = alice
        .get_job(v1::GetJobRequest { id: a1.id.clone() })
        .await
        .unwrap()
        .into_inner();
    assert_eq!(now.state(), JobState::Pending);
    let (c, _) = code(cancel(&mut as_(g, Some(READER)).await, &a1.id).await);
    assert_eq!(c, Code::PermissionDenied);
    assert_eq!(
        cancel(&mut alice, &a1.id).await.unwrap().state(),
        JobState::Cancelled
    );
    assert_eq!(
        cancel(&mut as_(g, Some(OPS)).await, &b1.id)
            .await
            .unwrap()
            .state(),
        JobState::Cancelled
    );

    // A job name with markup is refused at submit, naming the field.
    let mut evil = job_spec("x");
    evil.name = r#""<>&'"#.into();
    let (c, m) = code(
        alice
            .submit_job(v1::SubmitJobRequest {
                spec: Some(evil),
                ..Default::default()
            })
            .await,
    );
    assert_eq!(c, Code::InvalidArgument, "{m}");
    assert!(m.contains("name"), "{m}");

    // The CLI sends its token from the environment, --token or
    // --token-file, and shows the owner.
    let a2 = submit(&mut alice, "a").await.unwrap();
    let o = accrue(g, &[("ACCRUE_TOKEN", READER)], &["status", &a2.id]);
    let out = String::from_utf8_lossy(&o.stdout);
    assert_eq!(
        o.status.code(),
        Some(0),
        "{out}{}",
        String::from_utf8_lossy(&o.stderr)
    );
    assert!(out.contains("owner      alice"), "{out}");
    let o = accrue(g, &[], &["--token", READER, "list"]);
    let out = String::from_utf8_lossy(&o.stdout);
    assert!(out.contains("OWNER") && out.contains("alice"), "{out}");
    let o = accrue(g, &[], &["status", &a2.id]);
    let err = String::from_utf8_lossy(&o.stderr);
    assert_eq!(o.status.code(), Some(2), "{err}");
    assert!(err.contains("Unauthenticated"), "{err}");
    let file = write(s.dir.path(), "bob.token", &format!("{BOB}\n"));
    let o = accrue(
        g,
        &[("ACCRUE_TOKEN_FILE", &file.display().to_string())],
        &["cancel", &a2.id],
    );
    let err = String::from_utf8_lossy(&o.stderr);
    assert_eq!(o.status.code(), Some(2), "{err}");
    assert!(
        err.contains("PermissionDenied") && err.contains("owned by alice"),
        "{err}"
    );
    let o = accrue(g, &[("ACCRUE_TOKEN", ALICE)], &["cancel", &a2.id]);
    assert_eq!(o.status.code(), Some(0));
    assert!(String::from_utf8_lossy(&o.stdout).contains("cancelled"));
    let o = accrue(
        g,
        &[("ACCRUE_TOKEN", ALICE), ("ACCRUE_TOKEN_FILE", "x")],
        &["list"],
    );
    assert!(String::from_utf8_lossy(&o.stderr).contains("give one"));
}

#[tokio::test]
async fn worker_service_needs_no_token_and_a_removed_token_stops_working() {
    let s = start();
    let g = s.coord.grpc.as_str();

    // WorkerService is not token-checked (mutual TLS guards it): a worker
    // attaches without any token and gets alice's job.
    let hello = v1::WorkerHello {
        worker_id: "w0".into(),
        data_addr: "127.0.0.1:9".into(),
        capacity: 1,
        ..Default::default()
    };
    let (tx, mut down) = fake_worker(g, hello).await;
    let mut alice = as_(g, Some(ALICE)).await;
    let job = submit(&mut alice, "a").await.unwrap();
    let m = tokio::time::timeout(Duration::from_secs(20), down.message())
        .await
        .expect("an assignment in time")
        .unwrap()
        .unwrap();
    assert!(
        matches!(&m.msg, Some(v1::coordinator_message::Msg::Assign(a)) if a.job_id == job.id),
        "{m:?}"
    );

    // Remove alice from the file: refused after the reload, no restart;
    // the others keep working.
    let mut reader = as_(g, Some(READER)).await;
    replace(
        &s.tokens,
        &tokens_toml(&[("reader", READER, &["read"]), ("ops", OPS, &["admin"])]),
    );
    let mut refused = None;
    let deadline = std::time::Instant::now() + Duration::from_secs(10);
    while std::time::Instant::now() < deadline {
        match list(&mut alice).await {
            Ok(_) => tokio::time::sleep(Duration::from_millis(50)).await,
            Err(e) => {
                refused = Some(e);
                break;
            }
        }
    }
    let e = refused.expect("alice's token still works 10 s after it was removed");
    assert_eq!(e.code(), Code::Unauthenticated, "{}", e.message());
    assert_eq!(list(&mut reader).await.unwrap().len(), 1);
    // The job alice submitted keeps its owner.
    assert_eq!(list(&mut reader).await.unwrap()[0].owner, "alice");
    drop(tx);
}

fn http(base: &str, path: &str, token: Option<&str>) -> reqwest::RequestBuilder {
    let r = creds().http().get(format!("https://{base}{path}"));
    match token {
        Some(t) => r.bearer_auth(t),
        None => r,
    }
}

fn assert_hardened(r: &reqwest::Response, what: &str) {
    let h = r.headers();
    assert_eq!(
        h.get("content-security-policy")
            .map(|v| v.to_str().unwrap()),
        Some("default-src 'self'"),
        "{what}"
    );
    assert_eq!(
        h.get("x-content-type-options").map(|v| v.to_str().unwrap()),
        Some("nosniff"),
        "{what}"
    );
    assert!(
        !h.keys().any(|k| k.as_str().starts_with("access-control-")),
        "{what}: CORS header in {h:?}"
    );
}

#[tokio::test]
async fn http_probes_are_open_the_rest_needs_scopes_and_text_stays_text() {
    let s = start();
    let (g, h) = (s.coord.grpc.as_str(), s.coord.http.as_str());

    for p in ["/healthz", "/readyz"] {
        let r = http(h, p, None).send().await.unwrap();
        assert_eq!(r.status(), 200, "{p}");
        assert_hardened(&r, p);
    }
    let mut markup = as_(g, Some(MARKUP)).await;
    let job = submit(&mut markup, "m").await.unwrap();
    assert_eq!(job.owner, MARKUP_NAME);
    let one = format!("/v1/jobs/{}", job.id);
    let series = format!("{one}/series");
    for p in [
        "/v1/jobs",
        one.as_str(),
        series.as_str(),
        "/v1/workers",
        "/v1/whoami",
        "/metrics",
        "/nothing",
    ] {
        let r = http(h, p, None).send().await.unwrap();
        assert_eq!(r.status(), 401, "{p} without a token");
        assert_hardened(&r, p);
        let challenge = r.headers()["www-authenticate"]
            .to_str()
            .unwrap()
            .to_string();
        assert!(challenge.starts_with("Bearer"), "{p}: {challenge}");
        let r = http(h, p, Some("not-a-token")).send().await.unwrap();
        assert_eq!(r.status(), 401, "{p} with an unknown token");
        // metrics reads nothing else; read does not scrape.
        let wrong = if p == "/metrics" { READER } else { SCRAPER };
        let r = http(h, p, Some(wrong)).send().await.unwrap();
        assert_eq!(r.status(), 403, "{p} with a wrong scope");
        assert_hardened(&r, p);
    }
    for (p, token) in [
        ("/v1/jobs", READER),
        (series.as_str(), READER),
        (one.as_str(), ALICE),
        ("/metrics", SCRAPER),
    ] {
        let r = http(h, p, Some(token)).send().await.unwrap();
        assert_eq!(r.status(), 200, "{p}");
        assert_hardened(&r, p);
    }

    // The page shell is open and holds no data (it reads the API with the
    // token; tests/dashboard.rs shows stored text stays text in a browser);
    // in JSON stored text is a string.
    for p in ["/", "/assets/app.js", "/assets/app.css"] {
        let r = http(h, p, None).send().await.unwrap();
        assert_eq!(r.status(), 200, "{p}");
        assert_hardened(&r, p);
        let body = r.text().await.unwrap();
        assert!(!body.contains(&job.id) && !body.contains("mal</b>"), "{p}");
    }
    let v: serde_json::Value = http(h, &one, Some(READER))
        .send()
        .await
        .unwrap()
        .json()
        .await
        .unwrap();
    assert_eq!(v["owner"], MARKUP_NAME);

    // Cancel is a POST with the token: read is not enough, another owner is
    // refused, a cross-site request is refused whoever sends it, admin may.
    let post = |token: &str| {
        creds()
            .http()
            .post(format!("https://{h}{one}/cancel"))
            .bearer_auth(token)
    };
    assert_eq!(post(READER).send().await.unwrap().status(), 403);
    let r = post(ALICE).send().await.unwrap();
    assert_eq!(r.status(), 403);
    assert!(r.text().await.unwrap().contains("may not cancel"));
    let r = post(OPS)
        .header("origin", "https://evil.example")
        .send()
        .await
        .unwrap();
    assert_eq!(r.status(), 403);
    assert!(r.text().await.unwrap().contains("cross-site"));
    assert_eq!(
        http(h, &format!("{one}/cancel"), Some(OPS))
            .send()
            .await
            .unwrap()
            .status(),
        405,
        "cancel is not a GET"
    );
    let r = post(OPS).send().await.unwrap();
    assert_eq!(r.status(), 200);
    assert_hardened(&r, "cancel");
    let v: serde_json::Value = r.json().await.unwrap();
    assert_eq!(v["state"], "cancelled");
}
