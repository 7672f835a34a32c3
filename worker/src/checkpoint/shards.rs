//! Weight folders as transformers writes them (`save_pretrained`): one
//! `model.safetensors`, or, above the shard size, shards
//! (`model-00001-of-00003.safetensors`, ...) and `model.safetensors.index.json`
//! whose `weight_map` names the shard of every tensor.
//!
//! The index is input from whoever wrote the folder, so it is checked
//! before any shard is opened: every shard is a plain file name inside the
//! folder (no separator, no `..`: an index cannot make the worker read
//! another file), at most [`MAX_SHARDS`] of them, and the tensors read are
//! exactly the ones the index maps to each shard (one the shard lacks, or a
//! tensor in two shards, is an error naming both).

use crate::checkpoint::MODEL_FILE;
use std::collections::{BTreeMap, HashMap, HashSet};
use std::path::{Path, PathBuf};

/// The index transformers writes beside the shards.
pub const INDEX_FILE: &str = "model.safetensors.index.json";

/// The most shards an index may name (transformers' largest published
/// checkpoints have a few hundred).
pub const MAX_SHARDS: usize = 10_000;

/// The largest index read (a few MB for the largest models).
const MAX_INDEX_BYTES: u64 = 64 << 20;

/// The shards of a folder and the tensors each must hold.
#[derive(Debug, Clone, PartialEq)]
pub struct Shards {
    /// Shard file names in the order the index first names them, each
    /// with the tensors it maps there.
    pub files: Vec<(String, Vec<String>)>,
}

/// A weight file and the tensors its index entry maps to it (None: one
/// file without an index: whatever it holds).
pub type WeightFile = (PathBuf, Option<Vec<String>>);

/// A weight file as read: its path, the tensors the index expects of it,
/// and the tensors it holds.
pub type ReadFile<T> = (PathBuf, Option<Vec<String>>, Vec<(String, T)>);

/// Whether `dir` holds weights transformers' way (either form).
pub fn is_weights_folder(dir: &Path) -> bool {
    dir.join(MODEL_FILE).is_file() || dir.join(INDEX_FILE).is_file()
}

/// The weight files of `path`: the file itself, a folder's
/// `model.safetensors`, or the shards its index names (checked, in the
/// index's order). The error is one line naming what is wrong.
pub fn weight_files(path: &Path) -> Result<Vec<WeightFile>, String> {
    if !path.is_dir() {
        return Ok(vec![(path.to_path_buf(), None)]);
    }
    if path.join(MODEL_FILE).is_file() {
        return Ok(vec![(path.join(MODEL_FILE), None)]);
    }
    let index = path.join(INDEX_FILE);
    if !index.is_file() {
        return Err(format!(
            "{} holds neither {MODEL_FILE} nor {INDEX_FILE} (with its shards)",
            path.display()
        ));
    }
    let size = std::fs::metadata(&index)
        .map_err(|e| format!("{}: {e}", index.display()))?
        .len();
    if size > MAX_INDEX_BYTES {
        return Err(format!(
            "{}: {size} bytes, more than the {MAX_INDEX_BYTES} an index may have",
            index.display()
        ));
    }
    let text = std::fs::read(&index).map_err(|e| format!("{}: {e}", index.display()))?;
    let shards = parse_index(&text).map_err(|e| format!("{}: {e}", index.display()))?;
    shards
        .files
        .into_iter()
        .map(|(name, tensors)| {
            let file = path.join(&name);
            if file.is_file() {
                Ok((file, Some(tensors)))
            } else {
                Err(format!(
                    "{} names shard {name}, which is not a file in {}",
                    INDEX_FILE,
                    path.display()
                ))
            }
        })
        .collect()
}

/// Parses an index's `weight_map` (tensor name -> shard file name) into
/// the shards in order of first appearance, each shard name checked.
pub fn parse_index(text: &[u8]) -> Result<Shards, String> {
    let v: serde_json::Value =
        serde_json::from_slice(text).map_err(|e| format!("not JSON: {e}"))?;
    let map = v
        .get("weight_map")
        .and_then(|m| m.as_object())
        .ok_or("no \"weight_map\" object (tensor name -> shard file)")?;
    if map.is_empty() {
        return Err("\"weight_map\" is empty".into());
    }
    let mut order: Vec<String> = Vec::new();
    let mut by_shard: HashMap<String, Vec<String>> = HashMap::new();
    for (tensor, shard) in map {
        let shard = shard
            .as_str()
            .ok_or_else(|| format!("weight_map[{tensor:?}] is not a file name"))?;
        check_shard_name(shard).map_err(|e| format!("weight_map[{tensor:?}] = {shard:?}: {e}"))?;
        let list = by_shard.entry(shard.to_string()).or_insert_with(|| {
            order.push(shard.to_string());
            Vec::new()
        });
        list.push(tensor.clone());
        if order.len() > MAX_SHARDS {
            return Err(format!("more than {MAX_SHARDS} shards"));
        }
    }
    let files = order
        .into_iter()
        .map(|s| {
            let tensors = by_shard.remove(&s).unwrap_or_default();
            (s, tensors)
        })
        .collect();
    Ok(Shards { files })
}

/// A shard is a plain `.safetensors` file name in the folder.
fn check_shard_name(name: &str) -> Result<(), &'static str> {
    let plain = !name.is_empty()
        && !name.contains(['/', '\\', '\0'])
        && name != "."
        && name != ".."
        && !name.starts_with('.');
    if !plain {
        return Err("a shard must be a plain file name in the folder (no path, not hidden)");
    }
    if !name.ends_with(".safetensors") {
        return Err("a shard must be a .safetensors file");
    }
    Ok(())
}

/// Joins the tensors of several files: each file's tensors must be those
/// its index entry names (None: whatever the file holds), and no name may
/// come from two files. `files` pairs each file's path with its tensors.
pub fn join<T>(files: Vec<ReadFile<T>>) -> Result<Vec<(String, T)>, String> {
    let mut seen: BTreeMap<String, PathBuf> = BTreeMap::new();
    let mut out = Vec::new();
    for (path, expected, tensors) in files {
        if let Some(expected) = expected {
            let have: HashSet<&str> = tensors.iter().map(|(n, _)| n.as_str()).collect();
            if let Some(missing) = expected.iter().find(|n| !have.contains(n.as_str())) {
                return Err(format!(
                    "{INDEX_FILE} maps {missing} to {}, which does not hold it",
                    path.display()
                ));
            }
        }
        for (name, t) in tensors {
            if let Some(first) = seen.get(&name) {
                return Err(format!(
                    "{name} is in both {} and {}",
                    first.display(),
                    path.display()
                ));
            }
            seen.insert(name.clone(), path.clone());
            out.push((name, t));
        }
    }
    Ok(out)
}

/// One model file of a step folder: its name, the tensors the index maps
/// to it (None: a single file, whatever it holds), its contents.
pub type ModelFile = (String, Option<Vec<String>>, Vec<u8>);

/// A step folder's model files out of its verified files (name ->
/// contents): `model.safetensors`, or the index and the shards it names,
/// each shard with the tensors the index maps to it. The error is one
/// line naming what the manifest lacks.
pub fn take_model_files(files: &mut BTreeMap<String, Vec<u8>>) -> Result<Vec<ModelFile>, String> {
    if let Some(bytes) = files.remove(MODEL_FILE) {
        return Ok(vec![(MODEL_FILE.to_string(), None, bytes)]);
    }
    let index = files.remove(INDEX_FILE).ok_or_else(|| {
        format!(
            "{} lists neither {MODEL_FILE} nor {INDEX_FILE}",
            super::manifest::MANIFEST_FILE
        )
    })?;
    let shards = parse_index(&index).map_err(|e| format!("{INDEX_FILE}: {e}"))?;
    shards
        .files
        .into_iter()
        .map(|(name, tensors)| {
            let bytes = files.remove(&name).ok_or_else(|| {
                format!(
                    "{INDEX_FILE} names {name}, which {} does not list",
                    super::manifest::MANIFEST_FILE
                )
            })?;
            Ok((name, Some(tensors), bytes))
        })
        .collect()
}

/// Whether `name` is one of a step folder's model files (`accrue sample`
/// reads these and not the optimizer state).
pub fn is_model_file(name: &str) -> bool {
    name == MODEL_FILE
        || name == INDEX_FILE
        || (name.starts_with("model-") && name.ends_with(".safetensors"))
}

/// The shards `sizes` (each tensor's name and bytes, in order) are
/// written in, as huggingface_hub's `split_state_dict_into_shards` splits
/// for `save_pretrained`: in order, a new shard when the next tensor would
/// take the current one past `max` bytes; a tensor above `max` alone in its
/// own shard. Each shard is a list of indices into `sizes`; one shard means
/// a single `model.safetensors`.
pub fn plan(sizes: &[u64], max: u64) -> Vec<Vec<usize>> {
    let mut shards: Vec<Vec<usize>> = Vec::new();
    let mut current: Vec<usize> = Vec::new();
    let mut current_bytes = 0u64;
    for (i, &size) in sizes.iter().enumerate() {
        if size > max {
            if !current.is_empty() {
                shards.push(std::mem::take(&mut current));
                current_bytes = 0;
            }
            shards.push(vec![i]);
            continue;
        }
        if !current.is_empty() && current_bytes + size > max {
            shards.push(std::mem::take(&mut current));
            current_bytes = 0;
        }
        current.push(i);
        current_bytes += size;
    }
    if !current.is_empty() || shards.is_empty() {
        shards.push(current);
    }
    shards
}

/// Shard `i` (from 0) of `n`'s file name, as transformers names them:
/// `model-00001-of-00003.safetensors`.
pub fn shard_name(i: usize, n: usize) -> String {
    format!("model-{:05}-of-{n:05}.safetensors", i + 1)
}

/// The index transformers writes beside shards: `metadata.total_size` (the
/// tensors' bytes) and `weight_map` (tensor name -> shard file).
pub fn index_json(total_size: u64, weight_map: &[(String, String)]) -> Vec<u8> {
    let map: serde_json::Map<String, serde_json::Value> = weight_map
        .iter()
        .map(|(t, f)| (t.clone(), serde_json::Value::String(f.clone())))
        .collect();
    let v = serde_json::json!({"metadata": {"total_size": total_size}, "weight_map": map});
    // A map of strings always serialises.
    serde_json::to_vec_pretty(&v).unwrap_or_default()
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn an_index_names_its_shards_in_order_with_their_tensors() {
        let idx = br#"{"metadata": {"total_size": 10}, "weight_map": {
            "a.weight": "model-00001-of-00002.safetensors",
            "b.weight": "model-00002-of-00002.safetensors",
            "c.weight": "model-00001-of-00002.safetensors"}}"#;
        let s = parse_index(idx).unwrap();
        assert_eq!(s.files.len(), 2);
        assert_eq!(s.files[0].0, "model-00001-of-00002.safetensors");
        let mut first = s.files[0].1.clone();
        first.sort();
        assert_eq!(first, vec!["a.weight", "c.weight"]);
        assert_eq!(s.files[1].1, vec!["b.weight"]);
    }

    #[test]
    fn an_index_cannot_reach_outside_its_folder() {
        for bad in [
            "../model.safetensors",
            "/etc/passwd.safetensors",
            "sub/x.safetensors",
            "..",
            ".hidden.safetensors",
            "model.bin",
        ] {
            let idx = format!(r#"{{"weight_map": {{"w": "{bad}"}}}}"#);
            let e = parse_index(idx.as_bytes()).unwrap_err();
            assert!(e.contains("weight_map[\"w\"]"), "{bad}: {e}");
        }
        assert!(parse_index(b"{}").unwrap_err().contains("weight_map"));
        assert!(parse_index(br#"{"weight_map": {}}"#)
            .unwrap_err()
            .contains("empty"));
        assert!(parse_index(b"[").unwrap_err().contains("not JSON"));
    }

    #[test]
    fn joined_shards_hold_what_the_index_says_once() {
        let p = |s: &str| PathBuf::from(s);
        let t = |n: &str| (n.to_string(), 0u8);
        let ok = join(vec![
            (p("a"), Some(vec!["x".into()]), vec![t("x")]),
            (p("b"), None, vec![t("y")]),
        ])
        .unwrap();
        assert_eq!(ok.len(), 2);
        let missing = join(vec![(p("a"), Some(vec!["z".into()]), vec![t("x")])]).unwrap_err();
        assert!(missing.contains("maps z to a"), "{missing}");
        let twice = join(vec![
            (p("a"), None, vec![t("x")]),
            (p("b"), None, vec![t("x")]),
        ])
        .unwrap_err();
        assert!(twice.contains("x is in both a and b"), "{twice}");
    }

    /// huggingface_hub's rule: shards fill in order up to the limit, a
    /// tensor above it alone; every tensor in exactly one shard, in order.
    #[test]
    fn shards_fill_in_order_up_to_the_limit() {
        assert_eq!(plan(&[4, 4, 4], 8), vec![vec![0, 1], vec![2]]);
        assert_eq!(plan(&[4, 20, 4, 4], 8), vec![vec![0], vec![1], vec![2, 3]]);
        assert_eq!(plan(&[1, 2, 3], 100), vec![vec![0, 1, 2]]);
        assert_eq!(plan(&[], 8), vec![Vec::<usize>::new()]);
        assert_eq!(shard_name(0, 3), "model-00001-of-00003.safetensors");
        let idx = index_json(8, &[("w".into(), shard_name(1, 2))]);
        let parsed = parse_index(&idx).unwrap();
        assert_eq!(parsed.files[0].0, "model-00002-of-00002.safetensors");
    }

    proptest::proptest! {
        #[test]
        fn every_shard_is_within_the_limit_or_one_tensor(
            sizes in proptest::collection::vec(0u64..50, 0..30), max in 1u64..60,
        ) {
            let shards = plan(&sizes, max);
            let flat: Vec<usize> = shards.iter().flatten().copied().collect();
            proptest::prop_assert_eq!(flat, (0..sizes.len()).collect::<Vec<_>>());
            for s in &shards {
                let bytes: u64 = s.iter().map(|&i| sizes[i]).sum();
                proptest::prop_assert!(bytes <= max || s.len() == 1, "{s:?} {bytes}");
            }
            // Greedy: no shard could have taken the next one's first tensor.
            for w in shards.windows(2) {
                let bytes: u64 = w[0].iter().map(|&i| sizes[i]).sum();
                proptest::prop_assert!(bytes + sizes[w[1][0]] > max || sizes[w[0][0]] > max);
            }
        }
    }

    #[test]
    fn a_folder_without_weights_says_what_it_lacks() {
        let d = tempfile::TempDir::new().unwrap();
        let e = weight_files(d.path()).unwrap_err();
        assert!(e.contains(MODEL_FILE) && e.contains(INDEX_FILE), "{e}");
        std::fs::write(
            d.path().join(INDEX_FILE),
            br#"{"weight_map": {"w": "model-00001-of-00001.safetensors"}}"#,
        )
        .unwrap();
        let e = weight_files(d.path()).unwrap_err();
        assert!(e.contains("model-00001-of-00001.safetensors"), "{e}");
        std::fs::write(d.path().join("model-00001-of-00001.safetensors"), b"").unwrap();
        let files = weight_files(d.path()).unwrap();
        assert_eq!(files.len(), 1);
        assert_eq!(files[0].1, Some(vec!["w".to_string()]));
    }
}
