use super::disk::{Cut, Failing, Op, Recording};
use super::*;
use proptest::prelude::*;

fn me(job: &str) -> Owner {
    Owner {
        job_id: job.into(),
        cluster: String::new(),
        spec_hash: "h".into(),
        created_unix_ms: 0,
    }
}

fn opts(keep: usize) -> WriteOptions {
    WriteOptions {
        keep,
        owner: me("j"),
        protect_upto: None,
        max_shard: 50_000_000_000,
    }
}

/// A step's payload whose every value says the step: a mix of two steps
/// shows.
fn payload(step: u64) -> Payload {
    let state = TrainerState {
        job: "j".into(),
        job_id: "j".into(),
        step,
        samples_seen: step * 10,
        ..Default::default()
    };
    let v = step as f32;
    Payload::new(
        &state,
        &[("0.weight".into(), Tensor::from_slice(&[v; 6]).view([2, 3]))],
        &[(
            "0.weight.momentum_buffer".into(),
            Tensor::from_slice(&[-v; 6]).view([2, 3]),
        )],
        u64::MAX,
    )
    .unwrap()
}

/// The step a loaded checkpoint's tensors and counters say, asserting they
/// agree.
fn consistent_step(l: &Loaded) -> u64 {
    let m = Vec::<f32>::try_from(l.model[0].1.flatten(0, -1)).unwrap();
    let o = Vec::<f32>::try_from(l.optimizer[0].1.flatten(0, -1)).unwrap();
    let s = l.state.step;
    assert!(m.iter().all(|&x| x == s as f32), "model {m:?} at step {s}");
    assert!(
        o.iter().all(|&x| x == -(s as f32)),
        "optimizer {o:?} at step {s}"
    );
    assert_eq!(l.state.samples_seen, s * 10);
    s
}

fn names(dir: &Path) -> Vec<String> {
    let Ok(entries) = std::fs::read_dir(dir) else {
        return Vec::new();
    };
    let mut v: Vec<String> = entries
        .map(|e| e.unwrap().file_name().into_string().unwrap())
        .collect();
    v.sort();
    v
}

#[test]
fn the_writer_fsyncs_every_file_the_folder_and_the_parent_after_each_rename() {
    let d = tempfile::tempdir().unwrap();
    let dir = d.path().join("ck");
    let mut disk = Recording::default();
    write_on(&mut disk, &dir, 5, &payload(5), &opts(2)).unwrap();
    let ops = disk.ops;
    let pos = |op: &Op| {
        ops.iter()
            .position(|o| o == op)
            .unwrap_or_else(|| panic!("{op:?} not in {ops:#?}"))
    };
    let s = |p: PathBuf| p.display().to_string();
    let tmp = dir.join(format!(".step-5.tmp-{}", std::process::id()));
    let fin = dir.join("step-5");
    let rename = pos(&Op::Rename(s(tmp.clone()), s(fin.clone())));
    for f in [
        MODEL_FILE,
        OPTIMIZER_FILE,
        TRAINER_FILE,
        manifest::MANIFEST_FILE,
    ] {
        let w = pos(&Op::Write(s(tmp.join(f))));
        let sync = pos(&Op::SyncFile(s(tmp.join(f))));
        assert!(
            w < sync && sync < rename,
            "{f}: write {w}, fsync {sync}, rename {rename}"
        );
    }
    // The manifest is the last file written.
    assert!(
        pos(&Op::Write(s(tmp.join(manifest::MANIFEST_FILE))))
            > pos(&Op::SyncFile(s(tmp.join(TRAINER_FILE))))
    );
    let tmp_sync = pos(&Op::SyncDir(s(tmp.clone())));
    assert!(tmp_sync < rename);
    let latest_tmp = dir.join(format!(".LATEST.tmp-{}", std::process::id()));
    let latest_rename = pos(&Op::Rename(s(latest_tmp.clone()), s(dir.join(LATEST))));
    assert!(pos(&Op::SyncFile(s(latest_tmp))) < latest_rename);
    // The parent is fsynced after the step's rename and again after LATEST's.
    let parent_syncs: Vec<usize> = ops
        .iter()
        .enumerate()
        .filter(|(_, o)| **o == Op::SyncDir(s(dir.clone())))
        .map(|(i, _)| i)
        .collect();
    assert!(
        parent_syncs
            .iter()
            .any(|&i| i > rename && i < latest_rename),
        "{ops:#?}"
    );
    assert!(parent_syncs.iter().any(|&i| i > latest_rename), "{ops:#?}");
    // The owner record went first, durably, and the folder's parent too.
    let owner_sync = pos(&Op::SyncDir(s(dir.clone())));
    assert!(owner_sync < pos(&Op::CreateDir(s(tmp))));
    assert!(ops.contains(&Op::SyncDir(s(d.path().to_path_buf()))));
    assert_eq!(consistent_step(&read_latest(&dir).unwrap().unwrap()), 5);
}

#[test]
fn a_full_disk_at_any_operation_leaves_no_temporary_folder_and_latest_on_the_last_step() {
    let d = tempfile::tempdir().unwrap();
    let dir = d.path().join("ck");
    write_on(&mut disk::Local, &dir, 1, &payload(1), &opts(3)).unwrap();
    let mut count = Recording::default();
    let probe = d.path().join("probe");
    write_on(&mut count, &probe, 2, &payload(2), &opts(3)).unwrap();
    let n = count.ops.len();
    for at in 0..n {
        let mut full = Failing::new(at, Cut::Full);
        let r = write_on(&mut full, &dir, 2, &payload(2), &opts(3));
        let latest = read_latest(&dir).unwrap().unwrap();
        let left: Vec<String> = names(&dir)
            .into_iter()
            .filter(|n| n.contains(".tmp-"))
            .collect();
        assert!(left.is_empty(), "op {at}: left {left:?}");
        match r {
            Err(e) => {
                let e = e.to_string();
                // Before LATEST moved: it still names step-1, and says so.
                if consistent_step(&latest) == 1 {
                    assert!(e.contains("No space left on device"), "op {at}: {e}");
                }
            }
            Ok(_) => assert_eq!(consistent_step(&latest), 2, "op {at}"),
        }
        // Start each round from step-1 alone.
        let _ = std::fs::remove_dir_all(dir.join("step-2"));
        write_on(&mut disk::Local, &dir, 1, &payload(1), &opts(3)).unwrap();
    }
}

#[test]
fn recovery_without_latest_takes_the_newest_step_that_verifies_and_says_what_it_skipped() {
    let d = tempfile::tempdir().unwrap();
    let dir = d.path();
    for s in [16, 32, 48] {
        write_on(&mut disk::Local, dir, s, &payload(s), &opts(3)).unwrap();
    }
    let found = load_newest(dir, &me("j")).unwrap().unwrap();
    assert_eq!(
        (consistent_step(&found.loaded), found.fell_back),
        (48, false)
    );
    assert_eq!(found.why, "step-48 (named by LATEST)");
    // LATEST removed: the newest step that verifies.
    std::fs::remove_file(dir.join(LATEST)).unwrap();
    let found = load_newest(dir, &me("j")).unwrap().unwrap();
    assert_eq!(
        (consistent_step(&found.loaded), found.fell_back),
        (48, true)
    );
    assert!(found.why.contains("LATEST missing"), "{}", found.why);
    // The newest model.safetensors truncated: the previous step, naming why.
    let model = dir.join("step-48").join(MODEL_FILE);
    let len = std::fs::metadata(&model).unwrap().len();
    std::fs::OpenOptions::new()
        .write(true)
        .open(&model)
        .unwrap()
        .set_len(len / 2)
        .unwrap();
    let found = load_newest(dir, &me("j")).unwrap().unwrap();
    assert_eq!(consistent_step(&found.loaded), 32);
    assert!(
        found.why.contains("skipped step-48: model.safetensors")
            && found.why.contains("bytes, the manifest says"),
        "{}",
        found.why
    );
    // With LATEST back on the damaged step: the same fallback, said so.
    std::fs::write(dir.join(LATEST), "step-48\n").unwrap();
    let found = load_newest(dir, &me("j")).unwrap().unwrap();
    assert_eq!(consistent_step(&found.loaded), 32);
    assert!(
        found
            .why
            .contains("LATEST names step-48, which does not verify"),
        "{}",
        found.why
    );
    // Nothing readable: an error listing every step, never a fresh start.
    for s in [16, 32] {
        std::fs::remove_file(dir.join(format!("step-{s}")).join(manifest::MANIFEST_FILE)).unwrap();
    }
    let e = load_newest(dir, &me("j")).err().unwrap().to_string();
    for s in [
        "step-48:",
        "step-32: no MANIFEST.json",
        "step-16: no MANIFEST.json",
        "does not start again from step 0",
    ] {
        assert!(e.contains(s), "{s} not in {e}");
    }
    // An empty folder: a fresh start.
    assert!(load_newest(&dir.join("empty"), &me("j")).unwrap().is_none());
}

#[test]
fn another_jobs_folder_or_checkpoint_is_refused_naming_both() {
    let d = tempfile::tempdir().unwrap();
    let dir = d.path();
    write_on(&mut disk::Local, dir, 4, &payload(4), &opts(3)).unwrap();
    let e = load_newest(dir, &me("other")).err().unwrap().to_string();
    assert!(
        e.contains("belongs to job j") && e.contains("this is job other"),
        "{e}"
    );
    let mut o = opts(3);
    o.owner = me("other");
    let e = write_on(&mut disk::Local, dir, 8, &payload(8), &o)
        .unwrap_err()
        .to_string();
    assert!(e.contains("belongs to job j"), "{e}");
    assert_eq!(list_steps(dir).unwrap(), vec![4]);
    // A checkpoint of another job in an unclaimed folder (copied in).
    std::fs::remove_file(dir.join(owner::OWNER_FILE)).unwrap();
    let e = load_newest(dir, &me("other")).err().unwrap().to_string();
    assert!(e.contains("written by job j; this is job other"), "{e}");
}

#[test]
fn pruning_keeps_the_newest_and_never_touches_protected_or_newer_steps() {
    assert_eq!(to_prune(&[1, 2, 3, 4], 2, 4, None), vec![1, 2]);
    assert_eq!(to_prune(&[1, 2, 3, 4], 2, 4, Some(2)), Vec::<u64>::new());
    assert_eq!(to_prune(&[1, 2, 3, 4, 5], 2, 5, Some(2)), vec![3]);
    // Steps newer than the one written stay (a run that went back).
    assert_eq!(
        to_prune(&[150, 200, 250, 50], 1, 50, None),
        Vec::<u64>::new()
    );
    assert_eq!(to_prune(&[10, 50, 200], 1, 50, None), vec![10]);
    assert_eq!(to_prune(&[7], 0, 7, None), Vec::<u64>::new());
}

#[test]
fn choose_prefers_latest_then_the_newest_that_verifies() {
    let ok_but = |bad: &'static [u64]| {
        move |s: u64| {
            if bad.contains(&s) {
                Err("bad".to_string())
            } else {
                Ok(())
            }
        }
    };
    assert_eq!(choose(&Ok(None), &[], ok_but(&[])), Choice::Nothing);
    assert_eq!(
        choose(&Ok(Some(3)), &[1, 3, 5], ok_but(&[])),
        Choice::Take {
            step: 3,
            skipped: vec![],
            fell_back: false
        }
    );
    assert_eq!(
        choose(&Ok(Some(5)), &[1, 3, 5], ok_but(&[5])),
        Choice::Take {
            step: 3,
            skipped: vec![(5, "bad".into())],
            fell_back: true
        }
    );
    assert_eq!(
        choose(&Err("x".into()), &[1, 3], ok_but(&[3])),
        Choice::Take {
            step: 1,
            skipped: vec![(3, "bad".into())],
            fell_back: true
        }
    );
    assert!(matches!(
        choose(&Ok(Some(2)), &[], ok_but(&[2])),
        Choice::NoneReadable { .. }
    ));
}

/// Issue 37, item 2: the sweep removes accrue's own temporary names only
/// (a user's `.thesis.tmp-2024/` and `.cache.tmp-1` stay), and only under
/// the folder's writer lock, whatever pid the names carry.
#[test]
fn the_lock_holder_sweeps_only_accrues_temporary_names() {
    let d = tempfile::tempdir().unwrap();
    let dir = d.path();
    write_on(&mut disk::Local, dir, 1, &payload(1), &opts(3)).unwrap();
    let dead = dir.join(".step-2.tmp-999999999");
    std::fs::create_dir(&dead).unwrap();
    let live_pid = dir.join(format!(".LATEST.tmp-{}", std::process::id()));
    std::fs::write(&live_pid, b"x").unwrap();
    let thesis = dir.join(".thesis.tmp-2024");
    std::fs::create_dir(&thesis).unwrap();
    std::fs::write(thesis.join("chapter1.tex"), b"words").unwrap();
    std::fs::write(dir.join(".cache.tmp-1"), b"c").unwrap();
    let held = lock::FolderLock::acquire(dir, &me("j"), std::time::Duration::ZERO).unwrap();
    let removed = sweep(&held).unwrap();
    assert_eq!(removed, vec![live_pid, dead]);
    assert_eq!(
        names(dir),
        vec![
            ".accrue-writer.lock",
            ".cache.tmp-1",
            ".thesis.tmp-2024",
            "LATEST",
            "OWNER.json",
            "step-1"
        ]
    );
    assert!(thesis.join("chapter1.tex").exists());
}

proptest! {
    #![proptest_config(ProptestConfig { cases: 24, ..ProptestConfig::default() })]

    /// Writes of increasing steps, some cut at a random operation (a crash:
    /// nothing after it runs, the cut write leaves half its bytes), each
    /// followed by a resume as a new process would do it: LATEST, when
    /// present, names a step whose manifest verifies; the resume loads the
    /// newest completed step (or none before the first) and never a mix of
    /// two steps. Without LATEST (a crash before the first one) recovery
    /// takes the newest step renamed into place.
    #[test]
    fn crashes_at_any_operation_never_leave_latest_on_a_bad_step(
        plan in proptest::collection::vec((any::<bool>(), 0usize..40), 1..6),
        keep in 1usize..3,
    ) {
        let d = tempfile::tempdir().unwrap();
        let dir = d.path().join("ck");
        let (mut committed, mut renamed): (Option<u64>, Option<u64>) = (None, None);
        for (i, (crash, at)) in plan.iter().enumerate() {
            let step = (i as u64 + 1) * 4;
            let p = payload(step);
            let ok = if *crash {
                write_on(&mut Failing::new(*at, Cut::Crash), &dir, step, &p, &opts(keep)).is_ok()
            } else {
                write_on(&mut disk::Local, &dir, step, &p, &opts(keep)).unwrap();
                true
            };
            // LATEST moved to the step: it is the one to continue from.
            if ok || latest_name(&dir) == Ok(Some(step)) {
                committed = Some(step);
            }
            // Renamed into place: complete (its files and manifest were
            // fsynced before), the one to take when there is no LATEST.
            if dir.join(step_name(step)).exists() {
                renamed = Some(step);
            }
            let completed = match latest_name(&dir) {
                Ok(Some(_)) => committed,
                _ => renamed,
            };
            // The next process: sweep, then resume.
            if dir.exists() {
                let held = lock::FolderLock::acquire(&dir, &me("j"), std::time::Duration::ZERO).unwrap();
                sweep(&held).unwrap();
            }
            if let Ok(Some(n)) = latest_name(&dir) {
                prop_assert!(read(&dir.join(step_name(n))).is_ok(), "LATEST names step-{} which does not verify", n);
            }
            let found = load_newest(&dir, &me("j")).unwrap();
            let got = found.as_ref().map(|f| consistent_step(&f.loaded));
            prop_assert_eq!(got, completed);
            prop_assert!(!names(&dir).iter().any(|n| n.contains(".tmp-")));
        }
    }
}

#[test]
fn safetensors_bytes_round_trip_every_kind_and_shape_exactly() {
    let f = Tensor::from_slice(&[1.5f32, -0.0, f32::NAN, 3.0, 4.0, 5.0]).view([2, 3]);
    let tensors: Vec<(String, Tensor)> = vec![
        ("f32".into(), f.shallow_clone()),
        ("f32.transposed".into(), f.tr()),
        ("f64".into(), Tensor::from_slice(&[1e300f64, -2.0])),
        ("i64".into(), Tensor::from_slice(&[i64::MIN, 7])),
        ("bf16".into(), f.to_kind(tch::Kind::BFloat16)),
        ("bool".into(), Tensor::from_slice(&[true, false, true])),
        ("scalar".into(), Tensor::from(2.5f32)),
        (
            "empty".into(),
            Tensor::zeros([0, 4], (tch::Kind::Float, Device::Cpu)),
        ),
    ];
    let bytes = safetensors_bytes(&tensors).unwrap();
    // The header is padded to 8 bytes, as the format asks.
    let n = u64::from_le_bytes(bytes[..8].try_into().unwrap()) as usize;
    assert_eq!(n % 8, 0);
    let back: std::collections::HashMap<String, Tensor> = tensors_from(&bytes, Path::new("t"))
        .unwrap()
        .into_iter()
        .collect();
    assert_eq!(back.len(), tensors.len());
    for (name, t) in &tensors {
        let b = &back[name];
        assert_eq!((b.size(), b.kind()), (t.size(), t.kind()), "{name}");
        let bits = |x: &Tensor| {
            let x = x.contiguous();
            let mut v = vec![0u8; x.numel() * x.kind().elt_size_in_bytes()];
            x.copy_data_u8(&mut v, x.numel());
            v
        };
        assert_eq!(bits(b), bits(t), "{name}");
    }
}

/// Issue 39: a model above `max_shard` bytes is written as transformers
/// writes it (shards and their index, no model.safetensors), every file in
/// the manifest, and reads back to the same tensors; a shard the index
/// names but the manifest lacks is refused naming it.
#[test]
fn a_model_above_the_shard_size_is_written_as_shards_and_reads_back() {
    let d = tempfile::tempdir().unwrap();
    let dir = d.path().join("ck");
    let model: Vec<(String, Tensor)> = (0..5)
        .map(|i| {
            let t = Tensor::arange(6 * (i + 1), (tch::Kind::Float, tch::Device::Cpu)) * 0.5;
            (format!("layer.{i}.weight"), t)
        })
        .collect();
    let state = TrainerState {
        job: "j".into(),
        job_id: "j".into(),
        step: 3,
        ..Default::default()
    };
    // Tensors of 24, 48, 72, 96, 120 bytes under a 100-byte limit:
    // [24 48] [72] [96] [120 alone].
    let o = WriteOptions {
        max_shard: 100,
        ..opts(2)
    };
    let path = write(&dir, &state, &model, &[], &[], &o).unwrap();
    let files = names(&path);
    let shards: Vec<&String> = files.iter().filter(|n| n.starts_with("model-")).collect();
    assert_eq!(
        shards,
        [1, 2, 3, 4]
            .map(|i| format!("model-0000{i}-of-00004.safetensors"))
            .iter()
            .collect::<Vec<_>>(),
        "{files:?}"
    );
    assert!(files.contains(&shards::INDEX_FILE.to_string()), "{files:?}");
    assert!(!files.contains(&MODEL_FILE.to_string()), "{files:?}");
    let index =
        shards::parse_index(&std::fs::read(path.join(shards::INDEX_FILE)).unwrap()).unwrap();
    assert_eq!(index.files[0].1, vec!["layer.0.weight", "layer.1.weight"]);
    let back = read(&path).unwrap();
    assert_eq!(back.model.len(), model.len());
    for (n, t) in &model {
        // By name: a safetensors file's tensors come back in any order.
        let (_, bt) = back.model.iter().find(|(bn, _)| bn == n).unwrap();
        assert!(t.equal(bt), "{n}");
    }
    // Under the limit: one file, as before.
    let one = write(
        &dir,
        &TrainerState {
            step: 4,
            ..state.clone()
        },
        &model,
        &[],
        &[],
        &opts(2),
    )
    .unwrap();
    assert!(names(&one).contains(&MODEL_FILE.to_string()));
    assert!(!names(&one).contains(&shards::INDEX_FILE.to_string()));
    // A manifest without a shard its index names.
    let mut m: manifest::Manifest =
        serde_json::from_slice(&std::fs::read(path.join(manifest::MANIFEST_FILE)).unwrap())
            .unwrap();
    m.files
        .retain(|e| e.name != "model-00002-of-00004.safetensors");
    std::fs::write(
        path.join(manifest::MANIFEST_FILE),
        serde_json::to_vec(&m).unwrap(),
    )
    .unwrap();
    let e = read(&path).err().unwrap().to_string();
    assert!(
        e.contains("names model-00002-of-00004.safetensors, which MANIFEST.json does not list"),
        "{e}"
    );
}

/// A step folder written in parts (pipeline stages, issue 40): two
/// stages' shards and optimizer parts written into the writer's
/// temporary folder, the writer's index, trainer state and manifest last.
/// It reads back as one checkpoint; a part that fails leaves no folder and
/// LATEST on the last step; an optimizer tensor in two parts is refused.
#[test]
fn a_step_written_by_stages_reads_back_whole_and_a_failed_part_leaves_nothing() {
    let d = tempfile::tempdir().unwrap();
    let dir = d.path().join("ck");
    let mut disk = super::disk::Local;
    let t = |v: f32| Tensor::from_slice(&[v; 4]);
    let bytes = |ts: &[(&str, f32)]| {
        let named: Vec<(String, Tensor)> = ts.iter().map(|(n, v)| (n.to_string(), t(*v))).collect();
        safetensors_bytes(&named).unwrap()
    };
    let write_step = |disk: &mut super::disk::Local, step: u64, second_opt: &str| {
        let tmp = begin_step(disk, &dir, step, &me("j")).unwrap();
        assert!(!dir.join(step_name(step)).exists());
        let first = bytes(&[("embed.weight", 1.0), ("layers.0.w", 2.0)]);
        let first_opt = bytes(&[("embed.weight.exp_avg", 3.0)]);
        let second = bytes(&[("layers.1.w", 4.0)]);
        let second_opt = bytes(&[(second_opt, 5.0)]);
        let mut entries = write_part(
            disk,
            &tmp,
            &[
                (&shards::shard_name(0, 2), &first),
                (&optimizer_part_name(0, 2), &first_opt),
            ],
        )
        .unwrap();
        entries.extend(
            write_part(
                disk,
                &tmp,
                &[
                    (&shards::shard_name(1, 2), &second),
                    (&optimizer_part_name(1, 2), &second_opt),
                ],
            )
            .unwrap(),
        );
        let map: Vec<(String, String)> =
            [("embed.weight", 0), ("layers.0.w", 0), ("layers.1.w", 1)]
                .iter()
                .map(|(n, i)| (n.to_string(), shards::shard_name(*i, 2)))
                .collect();
        let state = TrainerState {
            job: "j".into(),
            job_id: "j".into(),
            step,
            ..Default::default()
        };
        let trainer = serde_json::to_vec(&state).unwrap();
        let index = shards::index_json(48, &map);
        entries.extend(
            write_part(
                disk,
                &tmp,
                &[(shards::INDEX_FILE, &index), (TRAINER_FILE, &trainer)],
            )
            .unwrap(),
        );
        finish_step(disk, &dir, step, &tmp, entries, &opts(3))
    };
    let path = write_step(&mut disk, 5, "layers.1.w.exp_avg").unwrap();
    let back = read(&path).unwrap();
    let value = |ts: &[(String, Tensor)], n: &str| {
        ts.iter()
            .find(|(m, _)| m == n)
            .map(|(_, t)| t.double_value(&[0]))
    };
    assert_eq!(back.model.len(), 3);
    assert_eq!(value(&back.model, "layers.1.w"), Some(4.0));
    assert_eq!(value(&back.optimizer, "embed.weight.exp_avg"), Some(3.0));
    assert_eq!(value(&back.optimizer, "layers.1.w.exp_avg"), Some(5.0));
    assert_eq!(latest_name(&dir).unwrap(), Some(5));
    // The same tensor's state in two parts.
    let path = write_step(&mut disk, 6, "embed.weight.exp_avg").unwrap();
    let e = read(&path).err().unwrap().to_string();
    assert!(
        e.contains("optimizer-00002-of-00002.safetensors holds embed.weight.exp_avg, which another optimizer part holds too"),
        "{e}"
    );
    // A part that failed: the writer abandons the step.
    let tmp = begin_step(&mut disk, &dir, 7, &me("j")).unwrap();
    write_part(
        &mut disk,
        &tmp,
        &[("model-00001-of-00002.safetensors", b"x")],
    )
    .unwrap();
    abandon_step(&mut disk, &tmp);
    assert!(!tmp.exists() && !dir.join(step_name(7)).exists());
    assert_eq!(latest_name(&dir).unwrap(), Some(6));
    // Another job's folder is refused before anything is written.
    let e = begin_step(&mut disk, &dir, 8, &me("other"))
        .err()
        .unwrap()
        .to_string();
    assert!(e.contains("other"), "{e}");
}
