//! Building one pipeline stage's parameters only (issue 40,
//! [`super::model::Model::build_stage`]): while a build runs under
//! [`during`], each family reports every parameter it makes ([`made`]),
//! and one the stage does not keep gives its storage back at once.
//! ZeRO-3 (issue 41, [`super::model::Model::build_sharded`]) builds the
//! same way under [`sharding`]: each parameter's values go to a [`Take`]
//! (this rank's chunk of them), then its storage is released, keeping its
//! shape, so the whole model never exists on one rank.

use crate::error::{Result, TorchContext};
use tch::Tensor;

/// Whether a pipeline stage's build keeps a parameter, by its name.
pub type Keep = Box<dyn Fn(&str) -> bool>;

/// What a ZeRO-3 build takes of each parameter's values as it is made.
pub type Take = Box<dyn FnMut(&str, &Tensor) -> Result<()>>;

/// Which parameters a stage build keeps (issue 40), and the shapes of the
/// others as they were released.
struct StageBuild {
    keep: Keep,
    released: Vec<(String, Vec<i64>)>,
}

thread_local! {
    /// Set while [`Model::build_stage`] runs on this thread.
    static STAGE_BUILD: std::cell::RefCell<Option<StageBuild>> =
        const { std::cell::RefCell::new(None) };
    /// Set while [`Model::build_sharded`] runs on this thread.
    static SHARD_BUILD: std::cell::RefCell<Option<Take>> =
        const { std::cell::RefCell::new(None) };
}

/// A family calls this right after it made parameter `name` (its full
/// name): under [`Model::build_stage`] a parameter the stage does not keep
/// gives its storage back at once (its values were drawn, so the
/// generator moves on as for the whole model), keeping its shape.
pub fn made(name: &str, t: &Tensor) -> Result<()> {
    let sharded = SHARD_BUILD.with(|b| -> Result<bool> {
        let mut b = b.borrow_mut();
        let Some(take) = b.as_mut() else {
            return Ok(false);
        };
        take(name, t)?;
        // One element of storage stays, so that the parameters keep
        // distinct addresses (the model names its parameters by them);
        // the shard's units replace it before anything reads it.
        crate::storage::resize(t, t.kind().elt_size_in_bytes())
            .ctx("releasing a sharded parameter")?;
        Ok(true)
    })?;
    if sharded {
        return Ok(());
    }
    STAGE_BUILD.with(|b| {
        let mut b = b.borrow_mut();
        let Some(build) = b.as_mut().filter(|b| !(b.keep)(name)) else {
            return Ok(());
        };
        build.released.push((name.to_string(), t.size()));
        let _guard = tch::no_grad_guard();
        let empty = Tensor::f_empty([0], (t.kind(), t.device()))
            .ctx("releasing another stage's parameter")?;
        let mut t = t.shallow_clone();
        t.f_set_data(&empty)
            .ctx("releasing another stage's parameter")
    })
}

/// Runs `build` with `take` given every reported parameter's values,
/// each released right after (ZeRO-3; None: nothing taken).
pub(super) fn sharding<T>(take: Option<Take>, build: impl FnOnce() -> T) -> T {
    SHARD_BUILD.with(|b| *b.borrow_mut() = take);
    let out = build();
    SHARD_BUILD.with(|b| b.borrow_mut().take());
    out
}

/// Runs `build` with `keep` deciding which reported parameters stay (None:
/// all of them, nothing recorded); returns its result and the released
/// parameters' names and shapes, in the order they were made.
pub(super) fn during<T>(
    keep: Option<Keep>,
    build: impl FnOnce() -> T,
) -> (T, Vec<(String, Vec<i64>)>) {
    STAGE_BUILD.with(|b| {
        *b.borrow_mut() = keep.map(|keep| StageBuild {
            keep,
            released: Vec::new(),
        })
    });
    let out = build();
    let released = STAGE_BUILD.with(|b| b.borrow_mut().take());
    (out, released.map(|r| r.released).unwrap_or_default())
}
