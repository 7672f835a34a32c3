//! As root: the tree as the image's file system, chrooted, as user 65532.

use super::*;

/// The tree as the image's file system: the worker's job runs chrooted
/// into it, as a container would (see [`run_chrooted`]). Needs root (a
/// mount namespace, chroot): ignored otherwise; `make test` runs it when
/// it runs as root (docs/DEVELOPING.md, "Tests that need root or CUDA").
#[test]
#[ignore = "needs root"]
fn the_runtime_tree_runs_chrooted_as_user_65532_as_root() {
    // SAFETY: geteuid has no preconditions.
    let euid = unsafe { libc::geteuid() };
    assert_eq!(
        euid, 0,
        "needs root (a mount namespace and chroot): run it as root, as `make test` does"
    );
    let tmp = tempfile::tempdir().unwrap();
    let tree = Tree {
        root: tmp.path().canonicalize().unwrap().join("tree"),
    };
    let o = assemble(&tree.root, &[]);
    assert!(
        o.status.success(),
        "assemble-runtime.sh failed:\n{}",
        show(&o)
    );
    run_chrooted(&tree);
}

/// Runs the worker's job chrooted into the tree, as a container would: its
/// own mount namespace, /proc mounted (glibc finds $ORIGIN through
/// /proc/self/exe), a /dev with only null, zero, full, random and urandom,
/// user and group 65532, an empty environment. Root only.
fn run_chrooted(tree: &Tree) {
    use std::ffi::CString;
    use std::os::unix::ffi::OsStrExt;
    use std::os::unix::process::CommandExt;
    let root = &tree.root;
    std::fs::create_dir_all(root.join("proc")).unwrap();
    std::fs::create_dir_all(root.join("dev")).unwrap();
    std::fs::write(root.join("tmp/job.toml"), JOB).unwrap();
    let c = |p: &Path| CString::new(p.as_os_str().as_bytes()).unwrap();
    let s = |s: &str| CString::new(s).unwrap();
    let (root_c, proc_c, dev_c) = (c(root), c(&root.join("proc")), c(&root.join("dev")));
    let nodes: Vec<(CString, CString)> = ["null", "zero", "full", "random", "urandom"]
        .iter()
        .map(|n| (c(&Path::new("/dev").join(n)), c(&root.join("dev").join(n))))
        .collect();
    let (slash, none, proc_fs, tmpfs, dev_opts) =
        (s("/"), s("none"), s("proc"), s("tmpfs"), s("mode=755"));
    let chrooted = |program: &str| {
        let (root_c, proc_c, dev_c, nodes) =
            (root_c.clone(), proc_c.clone(), dev_c.clone(), nodes.clone());
        let (slash, none, proc_fs, tmpfs, dev_opts) = (
            slash.clone(),
            none.clone(),
            proc_fs.clone(),
            tmpfs.clone(),
            dev_opts.clone(),
        );
        let mut cmd = Command::new(program);
        cmd.env_clear();
        // SAFETY: the closure runs in the forked child before exec and only
        // makes system calls on C strings prepared before the fork.
        unsafe {
            cmd.pre_exec(move || {
                let ok = |r: libc::c_int| {
                    if r == 0 {
                        Ok(())
                    } else {
                        Err(std::io::Error::last_os_error())
                    }
                };
                let null = std::ptr::null();
                ok(libc::unshare(libc::CLONE_NEWNS))?;
                ok(libc::mount(
                    none.as_ptr(),
                    slash.as_ptr(),
                    null,
                    libc::MS_REC | libc::MS_PRIVATE,
                    null as *const libc::c_void,
                ))?;
                ok(libc::mount(
                    proc_fs.as_ptr(),
                    proc_c.as_ptr(),
                    proc_fs.as_ptr(),
                    libc::MS_NOSUID | libc::MS_NODEV | libc::MS_NOEXEC,
                    null as *const libc::c_void,
                ))?;
                ok(libc::mount(
                    tmpfs.as_ptr(),
                    dev_c.as_ptr(),
                    tmpfs.as_ptr(),
                    libc::MS_NOSUID,
                    dev_opts.as_ptr() as *const libc::c_void,
                ))?;
                for (src, dst) in &nodes {
                    let fd = libc::open(dst.as_ptr(), libc::O_CREAT | libc::O_WRONLY, 0o644);
                    if fd < 0 {
                        return Err(std::io::Error::last_os_error());
                    }
                    libc::close(fd);
                    ok(libc::mount(
                        src.as_ptr(),
                        dst.as_ptr(),
                        null,
                        libc::MS_BIND,
                        null as *const libc::c_void,
                    ))?;
                }
                ok(libc::chroot(root_c.as_ptr()))?;
                ok(libc::chdir(slash.as_ptr()))?;
                ok(libc::setgroups(0, std::ptr::null()))?;
                ok(libc::setgid(65532))?;
                ok(libc::setuid(65532))?;
                Ok(())
            });
        }
        cmd
    };
    let t = Instant::now();
    let run = match chrooted("/usr/local/bin/accrue-worker")
        .args(["train", "/tmp/job.toml", "--state-dir", "/tmp/state"])
        .output()
    {
        Ok(o) => o,
        Err(e) if e.raw_os_error() == Some(libc::EPERM) => panic!(
            "no mount namespace here ({e}): root in an unprivileged container cannot run this test"
        ),
        Err(e) => panic!("cannot start the worker chrooted into the tree: {e}"),
    };
    eprintln!(
        "train chrooted into the tree as 65532: {:.2} s",
        t.elapsed().as_secs_f64()
    );
    assert!(run.status.success(), "{}", show(&run));
    assert!(
        text(&run.stdout).contains("finished at step 4: 64 samples"),
        "{}",
        show(&run)
    );
    let o = chrooted("/usr/local/bin/accrue")
        .arg("--version")
        .output()
        .unwrap();
    assert!(o.status.success(), "{}", show(&o));
    let o = chrooted("/usr/local/bin/accrue-coordinator")
        .arg("--help")
        .output()
        .unwrap();
    assert!(o.status.success(), "{}", show(&o));
}
