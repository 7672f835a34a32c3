//! Building one pipeline stage's parameters only (issue 40,
//! [`super::model::Model::build_stage`]): while a build runs under
//! [`during`], each family reports every parameter it makes ([`made`]),
//! and one the stage does not keep gives its storage back at once.

use crate::error::{Result, TorchContext};
use tch::Tensor;

/// Whether a pipeline stage's build keeps a parameter, by its name.
pub type Keep = Box<dyn Fn(&str) -> bool>;

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
}

/// A family calls this right after it made parameter `name` (its full
/// name): under [`Model::build_stage`] a parameter the stage does not keep
/// gives its storage back at once (its values were drawn, so the
/// generator moves on as for the whole model), keeping its shape.
pub fn made(name: &str, t: &Tensor) -> Result<()> {
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
