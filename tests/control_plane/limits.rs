//! Sizes: list paging, a page of maximal jobs, an oversized spec, a garbage protobuf body.

use super::*;

/// A spec at every size limit (issue 28): each path field 4096 bytes (a
/// TorchScript model, so `model.path` is allowed), a checkpoint folder of
/// its own (`i`).
fn maximal_spec(i: usize) -> v1::JobSpec {
    let path = |tag: &str| {
        let head = format!("/tmp/accrue-maximal/{tag}-{i}/");
        format!(
            "{head}{}",
            "p".repeat(accrue_common::spec::MAX_PATH_BYTES - head.len())
        )
    };
    let mut s = spec(&job_toml("max", 1, 4, ""));
    let model = s.model.as_mut().unwrap();
    model.kind = v1::ModelKind::Torchscript as i32;
    model.hidden.clear();
    model.path = Some(path("model"));
    model.init = Some(path("init"));
    let data = s.data.as_mut().unwrap();
    data.path = Some(path("data"));
    data.eval_path = Some(path("eval"));
    s.checkpoint.get_or_insert_with(Default::default).dir = Some(path("ckpt"));
    s
}

/// Issue 28: ListJobs pages as AIP-158 says, through the real gRPC API.
/// 230 jobs at every size limit (about 21 KiB each, 4.8 MB together: one
/// answer with all of them is RESOURCE_EXHAUSTED for every standard
/// client): a page of 1000 asked for is cut to what a client with the
/// default 4 MiB limit accepts; the default pages (100) go through every
/// job once, in creation order, while jobs are added between pages;
/// `accrue list` follows the pages; bad sizes and tokens are
/// INVALID_ARGUMENT; `GET /v1/jobs` pages the same way.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn list_jobs_pages_and_a_page_of_maximal_jobs_fits_a_standard_client() {
    const N: usize = 230;
    let d = TempDir::new().unwrap();
    let h = coordinator(d.path()).await;
    let grpc = h.grpc_addr.to_string();
    let mut c = client(&grpc).await;
    let started = std::time::Instant::now();
    let tasks: Vec<_> = (0..4)
        .map(|t| {
            let mut c = c.clone();
            tokio::spawn(async move {
                for i in (t..N).step_by(4) {
                    c.submit_job(v1::SubmitJobRequest {
                        spec: Some(maximal_spec(i)),
                        ..Default::default()
                    })
                    .await
                    .unwrap();
                }
            })
        })
        .collect();
    for t in tasks {
        t.await.unwrap();
    }
    eprintln!("{N} maximal jobs submitted in {:.1?}", started.elapsed());
    // A standard client: tonic's default limits (4 MiB, as grpcio's).
    let channel =
        accrue_proto::tls::endpoint(&format!("https://{grpc}"), Some(&creds().client_tls()))
            .unwrap()
            .connect()
            .await
            .unwrap();
    let token = accrue::BearerToken::new(&creds().token("read")).unwrap();
    let mut standard = v1::job_service_client::JobServiceClient::with_interceptor(channel, token);
    let list = |page_size: i32, page_token: &str| v1::ListJobsRequest {
        page_size,
        page_token: page_token.into(),
    };
    let full = standard
        .list_jobs(list(1000, ""))
        .await
        .expect("a page within the standard limit")
        .into_inner();
    let bytes = prost::Message::encoded_len(&full);
    eprintln!("page_size 1000: {} jobs, {bytes} bytes", full.jobs.len());
    assert!(bytes <= 4 << 20, "{bytes}");
    assert!(
        (150..N).contains(&full.jobs.len()),
        "cut by bytes, not to nothing: {}",
        full.jobs.len()
    );
    assert!(!full.next_page_token.is_empty());
    // The default pages, a job added after each: none skipped or repeated.
    let mut ids = Vec::new();
    let mut added = Vec::new();
    let mut token = String::new();
    let mut sizes = Vec::new();
    loop {
        let p = standard
            .list_jobs(list(0, &token))
            .await
            .unwrap()
            .into_inner();
        sizes.push(p.jobs.len());
        ids.extend(p.jobs.into_iter().map(|j| j.id));
        if p.next_page_token.is_empty() {
            break;
        }
        token = p.next_page_token;
        added.push(submit_text(&mut c, &job_toml("late", 1, 4, "")).await.id);
    }
    let expected: Vec<String> = (1..=N)
        .map(|s| format!("max-{s}"))
        .chain(added.iter().cloned())
        .collect();
    assert_eq!(sizes, [100, 100, 32]);
    assert_eq!(ids, expected, "every job once, in creation order");
    // `accrue list` follows the pages (1000 asked, cut by bytes).
    let out = tokio::task::spawn_blocking({
        let grpc = grpc.clone();
        move || {
            cli("read")
                .args(["--coordinator", &grpc, "list"])
                .output()
                .unwrap()
        }
    })
    .await
    .unwrap();
    let text = String::from_utf8_lossy(&out.stdout);
    assert!(
        out.status.success(),
        "{}",
        String::from_utf8_lossy(&out.stderr)
    );
    let listed: Vec<&str> = text
        .lines()
        .skip(1)
        .filter_map(|l| l.split_whitespace().next())
        .collect();
    assert_eq!(listed, expected);
    // Refused: a negative size, a token this coordinator did not issue.
    let e = standard.list_jobs(list(-1, "")).await.unwrap_err();
    assert_eq!(e.code(), tonic::Code::InvalidArgument, "{e:?}");
    assert!(
        e.message().starts_with("page_size = -1: must be >= 0"),
        "{}",
        e.message()
    );
    let e = standard
        .list_jobs(list(0, "bm90IGEgdG9rZW4"))
        .await
        .unwrap_err();
    assert_eq!(e.code(), tonic::Code::InvalidArgument, "{e:?}");
    assert!(
        e.message()
            .contains("not a page token this coordinator issued"),
        "{}",
        e.message()
    );
    // Clamped: 5000 is 1000 (then cut by bytes as above).
    let p = standard
        .list_jobs(list(5000, ""))
        .await
        .unwrap()
        .into_inner();
    assert_eq!(p.jobs.len(), full.jobs.len());
    // HTTP pages the same way.
    let http = h.http_addr.to_string();
    let page: serde_json::Value = creds()
        .get(&http, "/v1/jobs?page_size=50", "read")
        .await
        .unwrap()
        .json()
        .await
        .unwrap();
    assert_eq!(page["jobs"].as_array().unwrap().len(), 50);
    let next = page["next_page_token"].as_str().unwrap();
    let page: serde_json::Value = creds()
        .get(
            &http,
            &format!("/v1/jobs?page_size=50&page_token={next}"),
            "read",
        )
        .await
        .unwrap()
        .json()
        .await
        .unwrap();
    assert_eq!(page["jobs"][0]["id"], "max-51");
    let bad = creds()
        .get(&http, "/v1/jobs?page_token=zz", "read")
        .await
        .unwrap();
    assert_eq!(bad.status(), 400);
    h.stop().await;
}

/// Issue 28: an oversized path field (1 MB, unused by synthetic data) is
/// refused at submit with INVALID_ARGUMENT naming the field, in a short
/// message, and nothing is created; a spec file above 64 KiB is refused
/// by `accrue submit` before it sends anything.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn an_oversized_spec_is_refused_at_submit_naming_the_field() {
    let d = TempDir::new().unwrap();
    let h = coordinator(d.path()).await;
    let grpc = h.grpc_addr.to_string();
    let mut c = client(&grpc).await;
    let mut s = spec(&job_toml("big", 1, 4, ""));
    s.data.as_mut().unwrap().path = Some("x".repeat(1_000_000));
    let e = c
        .submit_job(v1::SubmitJobRequest {
            spec: Some(s),
            ..Default::default()
        })
        .await
        .unwrap_err();
    assert_eq!(e.code(), tonic::Code::InvalidArgument, "{e:?}");
    let m = e.message();
    assert!(
        m.contains("data.path = \"xxxx")
            && m.contains("… (1000000 bytes): must be at most 4096 bytes"),
        "{m}"
    );
    assert!(m.len() < 300, "{} characters", m.len());
    let listed = c
        .list_jobs(v1::ListJobsRequest::default())
        .await
        .unwrap()
        .into_inner();
    assert!(listed.jobs.is_empty(), "nothing half-created: {listed:?}");
    // A spec file of 70 KiB (a long comment): refused by the CLI.
    let text = format!("{}#{}\n", job_toml("big", 1, 4, ""), "p".repeat(70 << 10));
    let file = write(d.path(), "big.toml", &text);
    let out = tokio::task::spawn_blocking(move || {
        cli("submit")
            .args(["--coordinator", &grpc, "submit"])
            .arg(&file)
            .output()
            .unwrap()
    })
    .await
    .unwrap();
    let err = String::from_utf8_lossy(&out.stderr);
    assert_eq!(out.status.code(), Some(2), "{err}");
    assert!(err.contains("is larger than 65536 bytes (64 KiB)"), "{err}");
    h.stop().await;
}

/// Bytes sent as they are in gRPC's framing (a message that is not
/// protobuf), and the answer's bytes as they came.
#[derive(Clone, Copy, Default)]
struct Raw;

impl tonic::codec::Codec for Raw {
    type Encode = Vec<u8>;
    type Decode = Vec<u8>;
    type Encoder = Raw;
    type Decoder = Raw;
    fn encoder(&mut self) -> Raw {
        Raw
    }
    fn decoder(&mut self) -> Raw {
        Raw
    }
}

impl tonic::codec::Encoder for Raw {
    type Item = Vec<u8>;
    type Error = tonic::Status;
    fn encode(
        &mut self,
        item: Vec<u8>,
        buf: &mut tonic::codec::EncodeBuf<'_>,
    ) -> Result<(), tonic::Status> {
        prost::bytes::BufMut::put_slice(buf, &item);
        Ok(())
    }
}

impl tonic::codec::Decoder for Raw {
    type Item = Vec<u8>;
    type Error = tonic::Status;
    fn decode(
        &mut self,
        buf: &mut tonic::codec::DecodeBuf<'_>,
    ) -> Result<Option<Vec<u8>>, tonic::Status> {
        use prost::bytes::Buf;
        Ok(Some(buf.copy_to_bytes(buf.remaining()).to_vec()))
    }
}

/// Issue 28: a request body that is not protobuf (raw bytes in gRPC's
/// framing over HTTP/2, to the real server) is INVALID_ARGUMENT naming the
/// message, not INTERNAL.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_garbage_protobuf_body_is_invalid_argument() {
    let d = TempDir::new().unwrap();
    let h = coordinator(d.path()).await;
    let grpc = h.grpc_addr.to_string();
    let channel =
        accrue_proto::tls::endpoint(&format!("https://{grpc}"), Some(&creds().client_tls()))
            .unwrap()
            .connect()
            .await
            .unwrap();
    for (method, name) in [
        ("/accrue.v1.JobService/SubmitJob", "SubmitJobRequest"),
        ("/accrue.v1.JobService/ListJobs", "ListJobsRequest"),
        ("/accrue.v1.JobService/GetJob", "GetJobRequest"),
    ] {
        let mut g = tonic::client::Grpc::new(channel.clone());
        g.ready().await.unwrap();
        let mut req = tonic::Request::new(b"\xff\xff\xff\xff not protobuf".to_vec());
        req.metadata_mut().insert(
            "authorization",
            format!("Bearer {}", creds().token("admin"))
                .parse()
                .unwrap(),
        );
        let path = tonic::codegen::http::uri::PathAndQuery::from_static(method);
        let e = g.unary(req, path, Raw).await.unwrap_err();
        assert_eq!(e.code(), tonic::Code::InvalidArgument, "{method}: {e:?}");
        assert!(
            e.message()
                .starts_with(&format!("the {name} message does not decode as protobuf: ")),
            "{method}: {}",
            e.message()
        );
    }
    h.stop().await;
}

/// The peak resident memory (VmHWM) of process `pid`, bytes.
fn peak_rss(pid: u32) -> u64 {
    let status = std::fs::read_to_string(format!("/proc/{pid}/status")).unwrap();
    let kb: u64 = status
        .lines()
        .find_map(|l| l.strip_prefix("VmHWM:"))
        .and_then(|v| v.trim().trim_end_matches("kB").trim().parse().ok())
        .unwrap();
    kb * 1024
}

/// A language-model spec whose `model.config` is `config`.
fn llama_with_config(name: &str, config: &str) -> v1::JobSpec {
    // Fields only: the file is the coordinator's to judge.
    let text = format!(
        "name = \"{name}\"\nmax_steps = 2\ndevice = \"cpu\"\nthreads = 1\n[model]\nkind = \"llama\"\nconfig = \"{config}\"\n[data]\nkind = \"tokens\"\npath = \"train.bin\"\nseq_len = 8\nbatch_size = 2\n[optimizer]\nkind = \"adamw\"\nlr = 0.001\n"
    );
    let s = accrue_common::JobSpec::fields_from_toml_str(&text, std::path::Path::new("t.toml"))
        .unwrap();
    accrue_proto::spec_to_proto(&s)
}

/// Issue 37, item 1: a `model.config` naming `/dev/zero` or a 1 GB file
/// is refused at submit without being read (before: the coordinator read
/// `/dev/zero` to 11.7 GB, and a 1 GB file whole), and so is one that is
/// not JSON (before: ignored by the estimate, the job accepted). A daemon
/// confines the path before it reads it (before: it read a 1 GB file
/// outside `--model-root`, then refused). Both processes' peak memory is
/// measured.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn model_configs_cannot_exhaust_the_coordinator_or_a_daemon() {
    const LIMIT: u64 = 600 << 20;
    let d = TempDir::new().unwrap();
    let coord = spawn_coordinator(
        &coordinator_args(&d.path().join("state"), &[]),
        &d.path().join("coordinator.log"),
    );
    let mut c = client(&coord.grpc).await;
    // Sparse: 1 GiB long, no disk used.
    let big = d.path().join("big.json");
    std::fs::File::create(&big)
        .unwrap()
        .set_len(1 << 30)
        .unwrap();
    let not_json = d.path().join("bad.json");
    std::fs::write(&not_json, "{\"vocab_size\": 12,").unwrap();
    for (config, needle) in [
        (
            big.display().to_string(),
            "is 1073741824 bytes, above the 4194304-byte limit for a config.json",
        ),
        (
            "/dev/zero".to_string(),
            "is not a regular file (it is a character device)",
        ),
        (not_json.display().to_string(), "not valid JSON"),
    ] {
        let err = c
            .submit_job(v1::SubmitJobRequest {
                spec: Some(llama_with_config("cfg", &config)),
                ..Default::default()
            })
            .await
            .unwrap_err();
        assert_eq!(err.code(), tonic::Code::InvalidArgument, "{config}");
        assert!(
            err.message().contains("model.config") && err.message().contains(needle),
            "{config}: {}",
            err.message()
        );
        let peak = peak_rss(coord.child.id());
        assert!(
            peak < LIMIT,
            "the coordinator peaked at {peak} bytes after {config}"
        );
    }

    // The daemon's root holds a link to the 1 GB file; the coordinator
    // (another folder) does not see the relative path and leaves it to
    // the workers.
    let root = d.path().join("models");
    std::fs::create_dir(&root).unwrap();
    std::os::unix::fs::symlink(&big, root.join("cfg-37.json")).unwrap();
    let log = std::fs::File::create(d.path().join("w.log")).unwrap();
    let mut daemon = std::process::Command::new(worker_bin())
        .current_dir(&root)
        .args([
            "daemon",
            "--coordinator",
            &coord.grpc,
            "--id",
            "w",
            "--heartbeat",
            "0.2",
        ])
        .args(creds().worker_args("w"))
        .arg("--model-root")
        .arg(&root)
        .env("RUST_LOG", "info")
        .stdout(log.try_clone().unwrap())
        .stderr(log)
        .spawn()
        .unwrap();
    let job = c
        .submit_job(v1::SubmitJobRequest {
            spec: Some(llama_with_config("linked", "cfg-37.json")),
            ..Default::default()
        })
        .await
        .unwrap()
        .into_inner();
    let end = wait_state(
        &mut c,
        &job.id,
        &[JobState::Failed, JobState::Succeeded],
        Duration::from_secs(60),
    )
    .await;
    let peak = peak_rss(daemon.id());
    let _ = daemon.kill();
    let _ = daemon.wait();
    assert_eq!(end.state(), JobState::Failed, "{end:?}");
    assert!(end.error.contains("model.config"), "{}", end.error);
    assert!(peak < LIMIT, "the daemon peaked at {peak} bytes");
}
