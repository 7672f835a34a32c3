//! ListJobs pages (Google's AIP-158), pure: the request's checks, the page
//! token and the cut of one page.
//!
//! Jobs are listed in creation order: by the sequence number their id ends
//! with (`<name>-<n>`; the coordinator never reuses one, across restarts
//! and leaders included), then by id. A token names the last job of the
//! page it ended, so the next page starts after it wherever jobs were added
//! (always after every existing one) or removed meanwhile: pages never skip
//! or repeat a job. A page holds at most `page_size` jobs and, past its
//! first, at most a byte budget (gRPC: what a standard client accepts), so
//! a page may be shorter than asked before the last (AIP-158 allows it).

use accrue_common::spec::shown;
use accrue_proto::layout::{DEFAULT_PAGE_SIZE, MAX_PAGE_SIZE, MAX_PAGE_TOKEN_BYTES};

/// Where a job sorts in every listing.
#[derive(Clone, Debug, PartialEq, Eq, PartialOrd, Ord)]
pub struct Key {
    /// The sequence number its id ends with (0 for an id without one).
    pub seq: u64,
    pub id: String,
}

impl Key {
    pub fn of(id: &str) -> Self {
        Self {
            seq: seq_of(id).unwrap_or(0),
            id: id.to_string(),
        }
    }
}

/// The sequence number a job id ends with (`<name>-<n>`).
pub fn seq_of(id: &str) -> Option<u64> {
    id.rsplit('-').next().and_then(|n| n.parse().ok())
}

/// Why a ListJobs request is refused (INVALID_ARGUMENT).
#[derive(Clone, Debug, PartialEq, thiserror::Error)]
pub enum PageError {
    #[error("page_size = {0}: must be >= 0 (0 asks for the default, {DEFAULT_PAGE_SIZE}; above {MAX_PAGE_SIZE} gets {MAX_PAGE_SIZE})")]
    NegativeSize(i64),
    #[error("page_token = {token}: {why}; pass the next_page_token of the previous page, or \"\" for the first page")]
    BadToken { token: String, why: &'static str },
}

/// A checked request: at most `size` jobs, those after `after`.
#[derive(Clone, Debug, PartialEq)]
pub struct PageRequest {
    pub size: usize,
    pub after: Option<Key>,
}

/// Checks `page_size` (0: the default; above the maximum: the maximum;
/// negative: refused) and `page_token` ("" or one [`token`] issued).
pub fn request(page_size: i64, page_token: &str) -> Result<PageRequest, PageError> {
    let size = match page_size {
        n if n < 0 => return Err(PageError::NegativeSize(n)),
        0 => DEFAULT_PAGE_SIZE,
        n => usize::try_from(n).map_or(MAX_PAGE_SIZE, |n| n.min(MAX_PAGE_SIZE)),
    };
    let after = if page_token.is_empty() {
        None
    } else {
        Some(parse_token(page_token).map_err(|why| PageError::BadToken {
            token: shown(&format!("{page_token:?}")),
            why,
        })?)
    };
    Ok(PageRequest { size, after })
}

const TOKEN_VERSION: u8 = 1;

/// The token of the page after the one that ended with `last`: lowercase
/// hex of a version byte, the sequence number (8 bytes, big-endian) and
/// the id. Opaque to clients; [`request`] checks every part.
pub fn token(last: &Key) -> String {
    let mut bytes = vec![TOKEN_VERSION];
    bytes.extend_from_slice(&last.seq.to_be_bytes());
    bytes.extend_from_slice(last.id.as_bytes());
    bytes.iter().map(|b| format!("{b:02x}")).collect()
}

fn parse_token(t: &str) -> Result<Key, &'static str> {
    const FOREIGN: &str = "not a page token this coordinator issued";
    if t.len() > MAX_PAGE_TOKEN_BYTES || !t.len().is_multiple_of(2) {
        return Err(FOREIGN);
    }
    let bytes = (0..t.len())
        .step_by(2)
        .map(|i| {
            t.get(i..i + 2)
                .filter(|h| h.bytes().all(|c| matches!(c, b'0'..=b'9' | b'a'..=b'f')))
                .and_then(|h| u8::from_str_radix(h, 16).ok())
        })
        .collect::<Option<Vec<u8>>>()
        .ok_or(FOREIGN)?;
    let (head, id) = match bytes.split_first() {
        Some((&TOKEN_VERSION, rest)) if rest.len() > 8 => rest.split_at(8),
        _ => return Err(FOREIGN),
    };
    let mut seq = [0u8; 8];
    seq.copy_from_slice(head);
    let key = Key {
        seq: u64::from_be_bytes(seq),
        id: String::from_utf8(id.to_vec()).map_err(|_| FOREIGN)?,
    };
    // The two parts must agree, as in every token issued.
    if Key::of(&key.id) != key {
        return Err(FOREIGN);
    }
    Ok(key)
}

/// One page of `sorted` (ascending by `key`, keys distinct): the items
/// after `req.after`, at most `req.size` of them, and within `budget` by
/// `bytes` (the first item is always taken, so every page moves on), with
/// the next page's token ("" when this page reaches the end).
pub fn page<'a, T>(
    sorted: &'a [T],
    key: impl Fn(&T) -> Key,
    req: &PageRequest,
    bytes: impl Fn(&T) -> usize,
    budget: usize,
) -> (&'a [T], String) {
    let start = match &req.after {
        Some(after) => sorted.partition_point(|t| key(t) <= *after),
        None => 0,
    };
    let mut end = start;
    let mut used = 0usize;
    for t in sorted[start..].iter().take(req.size.max(1)) {
        let b = bytes(t);
        if end > start && used.saturating_add(b) > budget {
            break;
        }
        used = used.saturating_add(b);
        end += 1;
    }
    let next = match end.checked_sub(1) {
        Some(last) if end < sorted.len() => token(&key(&sorted[last])),
        _ => String::new(),
    };
    (&sorted[start..end], next)
}

#[cfg(test)]
mod tests {
    use super::*;
    use proptest::prelude::*;

    fn ids(n: u64) -> Vec<String> {
        (1..=n).map(|i| format!("job-{i}")).collect()
    }

    #[test]
    fn sizes_default_clamp_and_refuse() {
        assert_eq!(request(0, "").unwrap().size, 100);
        assert_eq!(request(7, "").unwrap().size, 7);
        assert_eq!(request(1000, "").unwrap().size, 1000);
        assert_eq!(request(1001, "").unwrap().size, 1000);
        assert_eq!(request(i64::MAX, "").unwrap().size, 1000);
        assert_eq!(
            request(-1, "").unwrap_err().to_string(),
            "page_size = -1: must be >= 0 (0 asks for the default, 100; above 1000 gets 1000)"
        );
    }

    #[test]
    fn tokens_round_trip_and_foreign_ones_are_refused() {
        let k = Key::of("lenet-mnist-42");
        assert_eq!(k.seq, 42);
        let t = token(&k);
        assert_eq!(request(0, &t).unwrap().after, Some(k));
        let id_without_seq = Key::of("x");
        assert_eq!(
            request(0, &token(&id_without_seq)).unwrap().after,
            Some(id_without_seq)
        );
        let long = "ab".repeat(300);
        let mismatched = {
            // seq 7 with the id of job 42.
            let mut b = vec![1u8];
            b.extend_from_slice(&7u64.to_be_bytes());
            b.extend_from_slice(b"lenet-mnist-42");
            b.iter().map(|b| format!("{b:02x}")).collect::<String>()
        };
        for bad in [
            "zz",
            "abc",
            "0100",
            &t.to_uppercase(),
            &format!("02{}", &t[2..]),
            &t[..18],
            &long,
            &mismatched,
            "é1",
        ] {
            let e = request(0, bad).unwrap_err();
            let text = e.to_string();
            assert!(
                text.starts_with("page_token = \"")
                    && text.contains("not a page token this coordinator issued"),
                "{bad}: {text}"
            );
            assert!(text.len() < 300, "{text}");
        }
    }

    #[test]
    fn pages_cut_by_count_and_by_bytes() {
        let all = ids(250);
        let req = request(0, "").unwrap();
        let (p, next) = page(&all, |id| Key::of(id), &req, |_| 1, usize::MAX);
        assert_eq!(p.len(), 100);
        assert_eq!(p[0], "job-1");
        let req = request(0, &next).unwrap();
        let (p, next) = page(&all, |id| Key::of(id), &req, |_| 1, usize::MAX);
        assert_eq!((p[0].as_str(), p.len()), ("job-101", 100));
        let (p, next) = page(
            &all,
            |id| Key::of(id),
            &request(0, &next).unwrap(),
            |_| 1,
            usize::MAX,
        );
        assert_eq!(
            (p.len(), next.as_str()),
            (50, ""),
            "the last page has no token"
        );
        // By bytes: 10 bytes each, 35 allowed: 3 per page.
        let (p, next) = page(
            &all,
            |id| Key::of(id),
            &request(1000, "").unwrap(),
            |_| 10,
            35,
        );
        assert_eq!(p.len(), 3);
        assert_eq!(request(0, &next).unwrap().after, Some(Key::of("job-3")));
        // One item bigger than the budget still makes a page of one.
        let (p, next) = page(
            &all,
            |id| Key::of(id),
            &request(5, "").unwrap(),
            |_| 100,
            35,
        );
        assert_eq!(p.len(), 1);
        assert!(!next.is_empty());
        // Ids sort by their number, not as text (job-10 after job-9).
        assert!(Key::of("job-9") < Key::of("job-10"));
        // Nothing after the end: an empty last page.
        let (p, next) = page(
            &all,
            |id| Key::of(id),
            &request(0, &token(&Key::of("job-250"))).unwrap(),
            |_| 1,
            9,
        );
        assert!(p.is_empty() && next.is_empty());
    }

    #[derive(Clone, Debug)]
    enum Change {
        /// Submit this many jobs (each after every existing one).
        Add(u8),
        /// Remove the job at this index (mod the count) (a withdrawn submission).
        Remove(u16),
    }

    fn change() -> impl Strategy<Value = Change> {
        prop_oneof![
            (0u8..20).prop_map(Change::Add),
            any::<u16>().prop_map(Change::Remove)
        ]
    }

    proptest! {
        /// Paging through a job set that changes between pages (jobs added
        /// after every existing one, some removed) never repeats a job and
        /// never skips one that was there all along or added before the
        /// last page; every page keeps to its size and its byte budget.
        #[test]
        fn pages_over_a_changing_set_never_skip_or_repeat(
            start in 0u64..300,
            sizes in proptest::collection::vec(-5i64..150, 1..60),
            changes in proptest::collection::vec(change(), 60),
            budget in 1usize..2000,
            weight in proptest::collection::vec(1usize..200, 1..20),
        ) {
            let mut jobs: Vec<String> = ids(start);
            let mut next_seq = start + 1;
            let initial = jobs.clone();
            let mut removed = std::collections::BTreeSet::new();
            let mut seen: Vec<Key> = Vec::new();
            let mut token = String::new();
            let bytes = |id: &String| weight[Key::of(id).seq as usize % weight.len()];
            let mut added_before_end = Vec::new();
            let mut ended = false;
            // Changes stop after the last one, so the listing ends.
            for (i, size) in sizes.iter().cycle().take(5000).enumerate() {
                let req = request((*size).max(0), &token).unwrap();
                let (p, next) = page(&jobs, |id| Key::of(id), &req, bytes, budget);
                prop_assert!(p.len() <= req.size);
                let used: usize = p.iter().map(bytes).sum();
                prop_assert!(p.len() <= 1 || used <= budget, "{} bytes in {} jobs", used, p.len());
                seen.extend(p.iter().map(|id| Key::of(id)));
                if next.is_empty() {
                    ended = true;
                    break;
                }
                token = next;
                let Some(c) = changes.get(i) else { continue };
                match c {
                    Change::Add(n) => {
                        for _ in 0..*n {
                            let id = format!("job-{next_seq}");
                            next_seq += 1;
                            added_before_end.push(id.clone());
                            jobs.push(id);
                        }
                    }
                    Change::Remove(at) if !jobs.is_empty() => {
                        let id = jobs.remove(*at as usize % jobs.len());
                        removed.insert(id);
                    }
                    Change::Remove(_) => {}
                }
            }
            prop_assert!(ended, "the listing ends");
            prop_assert!(seen.windows(2).all(|w| w[0] < w[1]), "in order, none twice");
            for id in initial.iter().chain(&added_before_end).filter(|id| !removed.contains(*id)) {
                prop_assert!(seen.contains(&Key::of(id)), "{} skipped", id);
            }
        }
    }
}
