//! Who else may write what decides who may do what (docs/SECURITY.md
//! "Local files"): the state dir (its tokens file, certificates and keys,
//! job store, ring secret) and the tokens file are refused when another
//! user owns them or may write them, as ssh's `StrictModes` refuses a
//! home folder or `authorized_keys` others can write.
//!
//! [`judge`] is the rule, pure: the owner must be this user or root, and
//! no group or other write bit may be set (a folder with the sticky bit,
//! like `/tmp`, is allowed only where [`Place::Parent`] says so: others
//! cannot rename or remove what they do not own there). As in Debian's
//! ssh, a group write bit is harmless when the group is the owner's
//! private group (the owner's primary group, no other member: what umask
//! 002 leaves on such systems). The walkers
//! ([`create_private_dir`], [`check_private_dir`], [`check_private_file`])
//! feed it what `stat` says.

use std::fmt;
use std::path::{Path, PathBuf};

/// A user id, shown as `uid N (name)` (the name when the host knows it).
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub struct Uid(pub u32);

impl fmt::Display for Uid {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        match user_name(self.0) {
            Some(n) => write!(f, "uid {} ({n})", self.0),
            None => write!(f, "uid {}", self.0),
        }
    }
}

/// The user name of `uid` from the host's user database, if it has one.
fn user_name(uid: u32) -> Option<String> {
    user_entry(uid).map(|(name, _)| name)
}

/// This process's effective user id.
pub fn current_uid() -> u32 {
    // SAFETY: geteuid cannot fail and touches no memory.
    unsafe { libc::geteuid() }
}

/// What `stat` says of a path: its owner, its group and its mode (type
/// bits too).
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub struct Stat {
    pub uid: u32,
    pub gid: u32,
    pub mode: u32,
}

impl Stat {
    fn of(m: &std::fs::Metadata) -> Self {
        use std::os::unix::fs::MetadataExt;
        Self {
            uid: m.uid(),
            gid: m.gid(),
            mode: m.mode(),
        }
    }

    fn is_dir(self) -> bool {
        self.mode & libc::S_IFMT == libc::S_IFDIR
    }

    /// Whether users other than the owner can reach entries in it (a
    /// folder with a group or other execute bit).
    fn reachable_by_others(self) -> bool {
        self.mode & 0o011 != 0
    }
}

/// Where a path stands, which decides whether a sticky folder is allowed.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub enum Place {
    /// The state dir or something in it: no group or other write bit.
    Private,
    /// The folder holding one private file: a sticky folder (`/tmp`, a
    /// Kubernetes secret volume) is allowed, others cannot replace the
    /// file there.
    Parent,
}

/// A path another user could use to take over what this process trusts.
#[derive(Debug, thiserror::Error)]
pub enum StrictModesError {
    #[error("{} is writable by other users (mode {:04o}, owner {owner}): another user could replace what is in it; run `chmod go-w {}`, or use another folder", path.display(), mode & 0o7777, path.display())]
    Writable {
        path: PathBuf,
        mode: u32,
        owner: Uid,
    },
    #[error("{} is owned by {owner} (mode {:04o}), not by this user ({me}) or root: its owner could replace what is in it; `chown` it to this user, or use another folder", path.display(), mode & 0o7777)]
    Owner {
        path: PathBuf,
        mode: u32,
        owner: Uid,
        me: Uid,
    },
    #[error("cannot check the owner and mode of {}: {source}", path.display())]
    Io {
        path: PathBuf,
        source: std::io::Error,
    },
}

impl StrictModesError {
    /// The path refused.
    pub fn path(&self) -> &Path {
        match self {
            Self::Writable { path, .. } | Self::Owner { path, .. } | Self::Io { path, .. } => path,
        }
    }
}

/// The rule, pure: `path` (as `st` describes it) is refused when its owner
/// is neither `me` nor root, when its other write bit is set, or its group
/// write bit unless `private_group` says its group is its owner's own
/// (a sticky folder in [`Place::Parent`] is allowed either way).
pub fn judge(
    path: &Path,
    st: Stat,
    me: u32,
    place: Place,
    private_group: bool,
) -> Result<(), StrictModesError> {
    if st.uid != me && st.uid != 0 {
        return Err(StrictModesError::Owner {
            path: path.to_path_buf(),
            mode: st.mode,
            owner: Uid(st.uid),
            me: Uid(me),
        });
    }
    let sticky_ok = place == Place::Parent && st.is_dir() && st.mode & libc::S_ISVTX != 0;
    let writable = if private_group { 0o002 } else { 0o022 };
    if st.mode & writable != 0 && !sticky_ok {
        return Err(StrictModesError::Writable {
            path: path.to_path_buf(),
            mode: st.mode,
            owner: Uid(st.uid),
        });
    }
    Ok(())
}

/// [`judge`] with the group looked up in this host's user database.
fn judge_here(path: &Path, st: Stat, me: u32, place: Place) -> Result<(), StrictModesError> {
    let private = st.mode & 0o020 != 0 && is_private_group(st.gid, st.uid);
    judge(path, st, me, place, private)
}

/// Whether `gid` is `uid`'s private group: its primary group, with no
/// member but that user (Debian's ssh takes such group write bits as
/// harmless).
fn is_private_group(gid: u32, uid: u32) -> bool {
    let Some((name, primary)) = user_entry(uid) else {
        return false;
    };
    primary == gid && group_members(gid).is_some_and(|m| m.iter().all(|n| *n == name))
}

/// The name and primary group of `uid`.
fn user_entry(uid: u32) -> Option<(String, u32)> {
    let mut buf = vec![0 as libc::c_char; 16 << 10];
    // SAFETY: an all-zero passwd is a valid value to be overwritten.
    let mut pwd: libc::passwd = unsafe { std::mem::zeroed() };
    let mut out: *mut libc::passwd = std::ptr::null_mut();
    // SAFETY: every pointer is valid for the call, `buf` for its length.
    let rc = unsafe { libc::getpwuid_r(uid, &mut pwd, buf.as_mut_ptr(), buf.len(), &mut out) };
    if rc != 0 || out.is_null() || pwd.pw_name.is_null() {
        return None;
    }
    // SAFETY: on success pw_name points at a NUL-terminated string in
    // `buf`, alive here.
    let name = unsafe { std::ffi::CStr::from_ptr(pwd.pw_name) };
    Some((name.to_string_lossy().into_owned(), pwd.pw_gid))
}

/// The listed members of group `gid` (None: unknown group).
fn group_members(gid: u32) -> Option<Vec<String>> {
    let mut buf = vec![0 as libc::c_char; 64 << 10];
    // SAFETY: an all-zero group is a valid value to be overwritten.
    let mut grp: libc::group = unsafe { std::mem::zeroed() };
    let mut out: *mut libc::group = std::ptr::null_mut();
    // SAFETY: every pointer is valid for the call, `buf` for its length.
    let rc = unsafe { libc::getgrgid_r(gid, &mut grp, buf.as_mut_ptr(), buf.len(), &mut out) };
    if rc != 0 || out.is_null() {
        return None;
    }
    let mut members = Vec::new();
    let mut p = grp.gr_mem;
    // SAFETY: on success gr_mem is a NULL-terminated array of
    // NUL-terminated strings in `buf`, alive here.
    unsafe {
        while !p.is_null() && !(*p).is_null() {
            members.push(std::ffi::CStr::from_ptr(*p).to_string_lossy().into_owned());
            p = p.add(1);
        }
    }
    Some(members)
}

fn stat(path: &Path, follow: bool) -> Result<Stat, StrictModesError> {
    let m = if follow {
        std::fs::metadata(path)
    } else {
        std::fs::symlink_metadata(path)
    };
    m.map(|m| Stat::of(&m))
        .map_err(|source| StrictModesError::Io {
            path: path.to_path_buf(),
            source,
        })
}

/// Creates `dir` (and missing parents) with mode 0700 when it does not
/// exist, then [`check_private_dir`]s it.
pub fn create_private_dir(dir: &Path) -> Result<(), StrictModesError> {
    use std::os::unix::fs::DirBuilderExt;
    std::fs::DirBuilder::new()
        .recursive(true)
        .mode(0o700)
        .create(dir)
        .map_err(|source| StrictModesError::Io {
            path: dir.to_path_buf(),
            source,
        })?;
    check_private_dir(dir)
}

/// Checks the state dir `dir` (links followed), everything directly in it
/// and everything directly in its folders: each must be owned by this user
/// or root; none may be writable by group or others where they can reach
/// it (a folder without group and other execute bits hides what is in it,
/// so a file there that umask 002 left group-writable is fine).
pub fn check_private_dir(dir: &Path) -> Result<(), StrictModesError> {
    let me = current_uid();
    let st = stat(dir, true)?;
    judge_here(dir, st, me, Place::Private)?;
    check_entries(dir, st.reachable_by_others(), me, 1)
}

/// Judges the entries of `dir` (`reachable`: whether other users can
/// reach them, through every folder above), and `depth` levels of folders
/// below.
fn check_entries(dir: &Path, reachable: bool, me: u32, depth: u32) -> Result<(), StrictModesError> {
    let io = |source| StrictModesError::Io {
        path: dir.to_path_buf(),
        source,
    };
    let gone = |e: &StrictModesError| matches!(e, StrictModesError::Io { source, .. } if source.kind() == std::io::ErrorKind::NotFound);
    let entries = match std::fs::read_dir(dir) {
        Ok(e) => e,
        // Removed meanwhile (a run holding the state dir prunes it).
        Err(e) if e.kind() == std::io::ErrorKind::NotFound => return Ok(()),
        Err(e) => return Err(io(e)),
    };
    for entry in entries {
        let path = entry.map_err(io)?.path();
        let own = match stat(&path, false) {
            Ok(s) => s,
            Err(e) if gone(&e) => continue,
            Err(e) => return Err(e),
        };
        let is_link = own.mode & libc::S_IFMT == libc::S_IFLNK;
        // A link's own mode means nothing; its owner and its target count.
        let target = if is_link {
            judge_here(&path, Stat { mode: 0, ..own }, me, Place::Private)?;
            match std::fs::metadata(&path) {
                Ok(m) => Stat::of(&m),
                // Dangling: nothing to open through it.
                Err(_) => continue,
            }
        } else {
            own
        };
        if reachable || is_link {
            judge_here(&path, target, me, Place::Private)?;
        } else {
            judge_here(&path, Stat { mode: 0, ..target }, me, Place::Private)?;
        }
        if depth > 0 && !is_link && target.is_dir() {
            check_entries(
                &path,
                reachable && target.reachable_by_others(),
                me,
                depth - 1,
            )?;
        }
    }
    Ok(())
}

/// Checks one file others must not replace (a tokens file): the file
/// (links followed) as [`Place::Private`], and the folder it really lies
/// in as [`Place::Parent`].
pub fn check_private_file(path: &Path) -> Result<(), StrictModesError> {
    let me = current_uid();
    judge_here(path, stat(path, true)?, me, Place::Private)?;
    let real = std::fs::canonicalize(path).map_err(|source| StrictModesError::Io {
        path: path.to_path_buf(),
        source,
    })?;
    if let Some(parent) = real.parent() {
        judge_here(parent, stat(parent, true)?, me, Place::Parent)?;
    }
    Ok(())
}

#[cfg(test)]
mod tests {
    use super::*;
    use std::os::unix::fs::PermissionsExt;

    const DIR: u32 = libc::S_IFDIR;
    const FILE: u32 = libc::S_IFREG;

    fn st(uid: u32, mode: u32) -> Stat {
        Stat {
            uid,
            gid: 5000,
            mode,
        }
    }

    #[test]
    fn group_or_other_write_bits_are_refused() {
        let p = Path::new("/s");
        for mode in [0o700, 0o755, 0o750, 0o711, 0o600, 0o644, 0o400] {
            judge(p, st(1000, DIR | mode), 1000, Place::Private, false).unwrap();
            judge(p, st(1000, FILE | mode), 1000, Place::Private, false).unwrap();
        }
        for mode in [
            0o777, 0o770, 0o775, 0o757, 0o702, 0o720, 0o666, 0o662, 0o620,
        ] {
            let e = judge(p, st(1000, DIR | mode), 1000, Place::Private, false).unwrap_err();
            assert!(matches!(e, StrictModesError::Writable { .. }), "{mode:o}");
            let text = e.to_string();
            assert!(text.contains(&format!("mode {mode:04o}")), "{text}");
            assert!(text.starts_with("/s is writable by other users"), "{text}");
            assert!(text.contains("uid 1000"), "{text}");
        }
    }

    #[test]
    fn a_group_write_bit_is_harmless_only_in_the_owners_private_group() {
        let p = Path::new("/s");
        for mode in [0o770, 0o775, 0o664, 0o620] {
            judge(p, st(1000, DIR | mode), 1000, Place::Private, true).unwrap();
        }
        for mode in [0o777, 0o666, 0o702] {
            assert!(judge(p, st(1000, DIR | mode), 1000, Place::Private, true).is_err());
        }
    }

    #[test]
    fn the_owner_must_be_this_user_or_root() {
        let p = Path::new("/s");
        judge(p, st(0, DIR | 0o755), 1000, Place::Private, false).unwrap();
        judge(p, st(0, DIR | 0o700), 0, Place::Private, false).unwrap();
        let e = judge(p, st(1001, DIR | 0o700), 1000, Place::Private, false).unwrap_err();
        assert!(matches!(e, StrictModesError::Owner { .. }), "{e}");
        let text = e.to_string();
        for part in [
            "/s is owned by uid 1001",
            "mode 0700",
            "not by this user (uid 1000",
        ] {
            assert!(text.contains(part), "{text:?} lacks {part:?}");
        }
        // Root runs are no exception: another user's folder is refused.
        assert!(judge(p, st(1001, DIR | 0o700), 0, Place::Private, false).is_err());
    }

    #[test]
    fn a_sticky_folder_is_allowed_only_as_a_parent() {
        let p = Path::new("/tmp");
        let tmp = st(0, DIR | 0o1777);
        judge(p, tmp, 1000, Place::Parent, false).unwrap();
        assert!(judge(p, tmp, 1000, Place::Private, false).is_err());
        // Not sticky: refused as a parent too.
        assert!(judge(p, st(0, DIR | 0o777), 1000, Place::Parent, false).is_err());
        // A sticky regular file means nothing.
        assert!(judge(p, st(0, FILE | 0o1666), 1000, Place::Parent, false).is_err());
    }

    fn chmod(p: &Path, mode: u32) {
        std::fs::set_permissions(p, std::fs::Permissions::from_mode(mode)).unwrap();
    }

    #[test]
    fn a_created_state_dir_is_0700_and_a_world_writable_one_is_refused() {
        let t = tempfile::tempdir().unwrap();
        let dir = t.path().join("a/state");
        create_private_dir(&dir).unwrap();
        let mode = std::fs::metadata(&dir).unwrap().permissions().mode() & 0o777;
        assert_eq!(mode, 0o700);
        // Group-writable entries of a folder nobody else can reach: fine.
        std::fs::create_dir(dir.join("tls")).unwrap();
        std::fs::write(dir.join("tls/tokens.toml"), "").unwrap();
        chmod(&dir.join("tls"), 0o777);
        chmod(&dir.join("tls/tokens.toml"), 0o666);
        check_private_dir(&dir).unwrap();
        // Reachable: the world-writable folder in it is named.
        chmod(&dir, 0o755);
        let e = check_private_dir(&dir).unwrap_err();
        assert_eq!(e.path(), dir.join("tls"), "{e}");
        assert!(e.to_string().contains("mode 0777"), "{e}");
        chmod(&dir.join("tls"), 0o755);
        let e = check_private_dir(&dir).unwrap_err();
        assert_eq!(e.path(), dir.join("tls/tokens.toml"), "{e}");
        chmod(&dir.join("tls/tokens.toml"), 0o600);
        check_private_dir(&dir).unwrap();
        // The state dir itself, pre-created world-writable.
        chmod(&dir, 0o777);
        let e = create_private_dir(&dir).unwrap_err();
        assert_eq!(e.path(), dir);
        assert!(e.to_string().contains("mode 0777"), "{e}");
    }

    #[test]
    fn a_tokens_file_is_judged_with_its_folder() {
        let t = tempfile::tempdir().unwrap();
        let f = t.path().join("tokens.toml");
        std::fs::write(&f, "").unwrap();
        chmod(&f, 0o644);
        check_private_file(&f).unwrap();
        chmod(&f, 0o646);
        assert!(matches!(
            check_private_file(&f),
            Err(StrictModesError::Writable { .. })
        ));
        chmod(&f, 0o600);
        chmod(t.path(), 0o777);
        let e = check_private_file(&f).unwrap_err();
        assert_eq!(e.path(), std::fs::canonicalize(t.path()).unwrap());
        chmod(t.path(), 0o1777);
        check_private_file(&f).unwrap();
        chmod(t.path(), 0o700);
    }
}
