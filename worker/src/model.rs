//! Models with PyTorch parameter names: `mlp` (torch.nn.Sequential of Linear
//! and ReLU: `0.weight`, `0.bias`, `2.weight`, ...), `lenet5` (conv1, conv2,
//! fc1..fc3), `resnet18`/`resnet34` (torchvision names) and `torchscript`
//! (a module saved with torch.jit.save, trained through libtorch).

use crate::error::{torch_text, Error, Result, TorchContext};
use crate::spec::{ModelKind, ModelSpec};
use std::collections::{HashMap, HashSet};
use std::path::Path;
use std::sync::Mutex;
use tch::nn::{self, Module, ModuleT};
use tch::{CModule, Device, Kind, Tensor};

/// Model construction draws from libtorch's process-global generator; this
/// lock plus a re-seed makes the initial weights a function of the job seed
/// even when several engines start at once (tests run on many threads).
static INIT_LOCK: Mutex<()> = Mutex::new(());

/// Tensors by PyTorch name.
pub type Named = Vec<(String, Tensor)>;

/// Where weights loaded by name come from: errors name the file
/// (`model.init`) or the checkpoint folder.
#[derive(Clone, Copy, Debug)]
pub enum WeightsFrom<'a> {
    /// `model.init`: a safetensors file.
    Init(&'a Path),
    /// A checkpoint's `step-<N>` folder.
    Checkpoint(&'a Path),
}

impl WeightsFrom<'_> {
    fn error(&self, reason: String) -> Error {
        match *self {
            WeightsFrom::Init(path) => Error::Init {
                path: path.to_path_buf(),
                reason,
            },
            WeightsFrom::Checkpoint(path) => Error::Checkpoint {
                path: path.to_path_buf(),
                reason,
            },
        }
    }

    /// How reasons call the source ("file", "checkpoint").
    fn noun(&self) -> &'static str {
        match self {
            WeightsFrom::Init(_) => "file",
            WeightsFrom::Checkpoint(_) => "checkpoint",
        }
    }
}

/// At most this many names are listed in a message.
const NAMES_SHOWN: usize = 3;

/// `names` as `["a", "b", "c"] and 4 more`.
fn some_names(names: &[&str]) -> String {
    let shown: Vec<&str> = names.iter().take(NAMES_SHOWN).copied().collect();
    match names.len().saturating_sub(NAMES_SHOWN) {
        0 => format!("{shown:?}"),
        more => format!("{shown:?} and {more} more"),
    }
}

/// The text of a panic caught around a built-in model's forward pass:
/// its first line, without the `unwrap` wrapper of tch's panicking ops.
fn panic_text(p: &(dyn std::any::Any + Send)) -> String {
    let msg = p
        .downcast_ref::<String>()
        .cloned()
        .or_else(|| p.downcast_ref::<&str>().map(|s| s.to_string()))
        .unwrap_or_default();
    let msg = msg
        .split_once("value: Torch(\"")
        .map_or(msg.as_str(), |(_, rest)| rest);
    crate::error::first_line(msg, 160)
}

/// A path as a spec value: `"dir/file.pt"`.
fn quoted(path: &Path) -> String {
    format!("\"{}\"", path.display())
}

enum Net {
    Builtin(Box<dyn ModuleT>),
    Script(CModule),
}

/// A model with its parameters and buffers listed by PyTorch name.
pub struct Model {
    /// Keeps the built-in layers' variables alive.
    _vs: Option<nn::VarStore>,
    net: Net,
    /// Trainable parameters, in creation order (the order buckets use).
    pub params: Named,
    /// Non-trainable state saved with the model (BatchNorm running stats).
    pub buffers: Named,
    pub kind: ModelKind,
}

impl std::fmt::Debug for Model {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.debug_struct("Model")
            .field("kind", &self.kind)
            .field("params", &self.params.len())
            .finish()
    }
}

#[derive(Debug)]
struct Mlp {
    layers: Vec<nn::Linear>,
}

impl Module for Mlp {
    fn forward(&self, xs: &Tensor) -> Tensor {
        let mut h = xs.flatten(1, -1);
        let last = self.layers.len().saturating_sub(1);
        for (i, l) in self.layers.iter().enumerate() {
            h = h.apply(l);
            if i < last {
                h = h.relu();
            }
        }
        h
    }
}

/// LeNet-5 with ReLU and max-pooling; conv1 pads by 2 so 28x28 inputs work
/// like the original 32x32. The PyTorch twin is in docs/SEMANTICS.md.
#[derive(Debug)]
struct LeNet5 {
    conv1: nn::Conv2D,
    conv2: nn::Conv2D,
    fc1: nn::Linear,
    fc2: nn::Linear,
    fc3: nn::Linear,
}

impl Module for LeNet5 {
    fn forward(&self, xs: &Tensor) -> Tensor {
        xs.apply(&self.conv1)
            .relu()
            .max_pool2d_default(2)
            .apply(&self.conv2)
            .relu()
            .max_pool2d_default(2)
            .flatten(1, -1)
            .apply(&self.fc1)
            .relu()
            .apply(&self.fc2)
            .relu()
            .apply(&self.fc3)
    }
}

fn lenet_features(h: i64, w: i64) -> i64 {
    let side = |s: i64| ((s / 2) - 4) / 2;
    16 * side(h).max(0) * side(w).max(0)
}

impl Model {
    /// Builds the model for inputs of `sample_shape` and `classes` outputs on
    /// `device`, seeded by `seed`, and checks one forward pass.
    pub fn build(
        spec: &ModelSpec,
        sample_shape: &[i64],
        classes: i64,
        device: Device,
        seed: u64,
    ) -> Result<Self> {
        let model = if spec.kind == ModelKind::Torchscript {
            let path = spec.path.clone().unwrap_or_default();
            let model = Self::load_script(&path, device)?;
            model.probe_gradients(&path, sample_shape, device)?;
            model
        } else {
            let _guard = INIT_LOCK
                .lock()
                .unwrap_or_else(|poisoned| poisoned.into_inner());
            tch::manual_seed(seed as i64);
            Self::build_builtin(spec, sample_shape, classes, device)?
        };
        model.probe(sample_shape, classes, device)?;
        Ok(model)
    }

    fn build_builtin(
        spec: &ModelSpec,
        shape: &[i64],
        classes: i64,
        device: Device,
    ) -> Result<Self> {
        let vs = nn::VarStore::new(device);
        let root = vs.root();
        let net: Box<dyn ModuleT> = match spec.kind {
            ModelKind::Mlp => {
                let mut widths = vec![shape.iter().product::<i64>()];
                widths.extend_from_slice(&spec.hidden);
                widths.push(classes);
                let layers = widths
                    .windows(2)
                    .enumerate()
                    .map(|(i, w)| {
                        nn::linear(&root / (2 * i).to_string(), w[0], w[1], Default::default())
                    })
                    .collect();
                Box::new(Mlp { layers })
            }
            ModelKind::Lenet5 => {
                let (c, h, w) = match shape {
                    [c, h, w] => (*c, *h, *w),
                    _ => {
                        return Err(Error::Model(format!(
                            "lenet5 needs image samples [C, H, W], the data has shape {shape:?}"
                        )))
                    }
                };
                let feat = lenet_features(h, w);
                if feat == 0 {
                    return Err(Error::Model(format!(
                        "lenet5 needs images of at least 12x12, the data has {h}x{w} \
                         (use model.kind = \"mlp\" for small inputs)"
                    )));
                }
                let conv = |p, i, o, pad| {
                    nn::conv2d(
                        p,
                        i,
                        o,
                        5,
                        nn::ConvConfig {
                            padding: pad,
                            ..Default::default()
                        },
                    )
                };
                Box::new(LeNet5 {
                    conv1: conv(&root / "conv1", c, 6, 2),
                    conv2: conv(&root / "conv2", 6, 16, 0),
                    fc1: nn::linear(&root / "fc1", feat, 120, Default::default()),
                    fc2: nn::linear(&root / "fc2", 120, 84, Default::default()),
                    fc3: nn::linear(&root / "fc3", 84, classes, Default::default()),
                })
            }
            ModelKind::Resnet18 | ModelKind::Resnet34 => {
                if shape.len() != 3 || shape[0] != 3 {
                    return Err(Error::Model(format!(
                        "{} needs 3-channel images [3, H, W], the data has shape {shape:?}",
                        spec.kind
                    )));
                }
                if spec.kind == ModelKind::Resnet18 {
                    Box::new(tch::vision::resnet::resnet18(&root, classes))
                } else {
                    Box::new(tch::vision::resnet::resnet34(&root, classes))
                }
            }
            ModelKind::Torchscript => {
                return Err(Error::Model(
                    "a torchscript model is loaded from model.path, not built".into(),
                ))
            }
        };
        let (params, buffers) = named_state(&vs);
        Ok(Self {
            _vs: Some(vs),
            net: Net::Builtin(net),
            params,
            buffers,
            kind: spec.kind,
        })
    }

    fn load_script(path: &Path, device: Device) -> Result<Self> {
        let field = |reason: String| Error::Field {
            field: "model.path",
            value: quoted(path),
            reason,
        };
        let module = CModule::load_on_device(path, device).map_err(|e| {
            field(format!(
                "not a TorchScript module libtorch can load (save one with torch.jit.save): {}",
                torch_text("loading the TorchScript module", &e)
            ))
        })?;
        let params = module
            .named_parameters()
            .ctx("listing TorchScript parameters")?;
        if params.is_empty() {
            return Err(field(
                "the TorchScript module has no parameters to train (named_parameters() is empty)"
                    .into(),
            ));
        }
        let params = params
            .into_iter()
            .map(|(n, t)| {
                Ok((
                    n,
                    if t.requires_grad() {
                        t
                    } else {
                        t.f_set_requires_grad(true).ctx("enabling gradients")?
                    },
                ))
            })
            .collect::<Result<Vec<_>>>()?;
        Ok(Self {
            _vs: None,
            net: Net::Script(module),
            params,
            buffers: Vec::new(),
            kind: ModelKind::Torchscript,
        })
    }

    /// A TorchScript module's output must depend on a parameter, or the
    /// first backward pass fails ("element 0 of tensors does not require
    /// grad"): one forward pass on a zero batch of 2 with gradients on.
    fn probe_gradients(&self, path: &Path, shape: &[i64], device: Device) -> Result<()> {
        let Net::Script(m) = &self.net else {
            return Ok(());
        };
        let mut dims = vec![2];
        dims.extend_from_slice(shape);
        let x = Tensor::f_zeros(dims.as_slice(), (Kind::Float, device)).ctx("probing the model")?;
        let out = tch::with_grad(|| m.forward_ts(&[&x])).map_err(|e| {
            Error::Model(format!(
                "torchscript module cannot take samples of shape {shape:?}: {}",
                torch_text("probing the TorchScript module", &e)
            ))
        })?;
        if !out.requires_grad() {
            return Err(Error::Field {
                field: "model.path",
                value: quoted(path),
                reason: "the TorchScript module's output does not depend on any of its \
                         parameters (nothing to train)"
                    .into(),
            });
        }
        Ok(())
    }

    /// One forward pass on a zero batch of 2 to turn shape errors into a
    /// clear message before training starts.
    fn probe(&self, shape: &[i64], classes: i64, device: Device) -> Result<()> {
        let mut dims = vec![2];
        dims.extend_from_slice(shape);
        let x = Tensor::f_zeros(dims.as_slice(), (Kind::Float, device)).ctx("probing the model")?;
        let _guard = tch::no_grad_guard();
        let out = match &self.net {
            Net::Builtin(m) => {
                let m = &**m;
                std::panic::catch_unwind(std::panic::AssertUnwindSafe(|| m.forward_t(&x, false)))
                    .map_err(|p| {
                        Error::Model(format!(
                            "{} cannot take samples of shape {shape:?}: {}",
                            self.kind,
                            panic_text(&*p)
                        ))
                    })?
            }
            Net::Script(m) => m.forward_ts(&[&x]).map_err(|e| {
                Error::Model(format!(
                    "torchscript module cannot take samples of shape {shape:?}: {}",
                    torch_text("probing the TorchScript module", &e)
                ))
            })?,
        };
        let got = out.size();
        if got.len() != 2 || got[1] != classes {
            return Err(Error::Model(format!(
                "{} returns shape {got:?} for 2 samples, expected [2, {classes}] (logits per class)",
                self.kind
            )));
        }
        Ok(())
    }

    pub fn forward(&self, xs: &Tensor, train: bool) -> Result<Tensor> {
        match &self.net {
            // tch's layers use panicking ops: a libtorch failure (out of
            // memory, say) becomes an error of the job, not a panic of its
            // thread.
            Net::Builtin(m) => {
                std::panic::catch_unwind(std::panic::AssertUnwindSafe(|| m.forward_t(xs, train)))
                    .map_err(|p| Error::Torch {
                        context: "running the model's forward pass",
                        message: panic_text(&*p),
                    })
            }
            Net::Script(m) => m.forward_ts(&[xs]).ctx("running the TorchScript module"),
        }
    }

    /// Switches a TorchScript module between train and eval mode (built-in
    /// models take the flag per call).
    pub fn set_train(&mut self, train: bool) -> Result<()> {
        if let Net::Script(m) = &mut self.net {
            if train {
                m.f_set_train()
            } else {
                m.f_set_eval()
            }
            .ctx("switching train/eval mode")?;
        }
        Ok(())
    }

    /// Parameters then buffers, by name.
    pub fn state(&self) -> impl Iterator<Item = &(String, Tensor)> {
        self.params.iter().chain(self.buffers.iter())
    }

    pub fn grads(&self) -> Vec<Tensor> {
        self.params.iter().map(|(_, p)| p.grad()).collect()
    }

    /// Loads weights by name, strictly: every parameter and buffer must be
    /// there with the same shape, and nothing else (BatchNorm's
    /// `num_batches_tracked` aside). Weights of another architecture are
    /// refused naming their source (the `model.init` file or the checkpoint
    /// folder) and the first difference in the model's order, with shapes.
    pub fn load_named(
        &mut self,
        from: WeightsFrom<'_>,
        tensors: Vec<(String, Tensor)>,
    ) -> Result<()> {
        let mut by_name: HashMap<String, Tensor> = tensors.into_iter().collect();
        if let Some(reason) = self.mismatch(from.noun(), &by_name) {
            return Err(from.error(reason));
        }
        let err = |reason: String| from.error(reason);
        let _guard = tch::no_grad_guard();
        for (name, t) in self.params.iter_mut().chain(self.buffers.iter_mut()) {
            let src = by_name
                .remove(name)
                .ok_or_else(|| err(format!("{name} vanished")))?;
            let src = src
                .f_to_kind(t.kind())
                .and_then(|s| s.f_to_device(t.device()))
                .ctx("loading weights")?;
            t.f_copy_(&src).ctx("loading weights")?;
        }
        Ok(())
    }

    /// Why `by_name` does not fit this model (None: it does): the first
    /// difference in the model's order ("2.weight: file [4, 15], model
    /// [4, 16]"), then the names missing and unexpected, or how many
    /// shapes differ. `noun` names the source ("file", "checkpoint").
    fn mismatch(&self, noun: &str, by_name: &HashMap<String, Tensor>) -> Option<String> {
        let ours: HashSet<&str> = self.state().map(|(n, _)| n.as_str()).collect();
        let mut unexpected: Vec<&str> = by_name
            .keys()
            .map(String::as_str)
            .filter(|k| !ours.contains(k) && !k.ends_with("num_batches_tracked"))
            .collect();
        unexpected.sort_unstable();
        let missing: Vec<&str> = self
            .state()
            .map(|(n, _)| n.as_str())
            .filter(|n| !by_name.contains_key(*n))
            .collect();
        let reshaped = self
            .state()
            .filter(|(n, t)| by_name.get(n).is_some_and(|src| src.size() != t.size()))
            .count();
        let first = self
            .state()
            .find_map(|(n, t)| match by_name.get(n) {
                None => Some(format!("{n}: {noun} has none, model {:?}", t.size())),
                Some(src) if src.size() != t.size() => Some(format!(
                    "{n}: {noun} {:?}, model {:?}",
                    src.size(),
                    t.size()
                )),
                Some(_) => None,
            })
            .or_else(|| {
                let n = unexpected.first()?;
                let size = by_name.get(*n).map(Tensor::size).unwrap_or_default();
                Some(format!("{n}: {noun} {size:?}, model has none"))
            })?;
        let detail = if !missing.is_empty() || !unexpected.is_empty() {
            format!(
                " (missing {}, unexpected {})",
                some_names(&missing),
                some_names(&unexpected)
            )
        } else if reshaped > 1 {
            format!(" ({reshaped} of {} tensors differ in shape)", ours.len())
        } else {
            String::new()
        };
        Some(format!(
            "another architecture than the {} model: first difference {first}{detail}",
            self.kind
        ))
    }
}

/// Puts parameters in `module.parameters()` order: modules in creation
/// order, and within a module `weight` before `bias` (tch creates the bias
/// first).
fn order_like_pytorch(params: &mut [(String, Tensor)]) {
    let prefix = |n: &str| {
        n.rsplit_once('.')
            .map_or(String::new(), |(p, _)| p.to_string())
    };
    let mut first_seen: HashMap<String, usize> = HashMap::new();
    for (i, (n, _)) in params.iter().enumerate() {
        first_seen.entry(prefix(n)).or_insert(i);
    }
    let leaf_rank = |n: &str| match n.rsplit('.').next() {
        Some("weight") => 0,
        Some("bias") => 1,
        _ => 2,
    };
    params.sort_by_key(|(n, _)| (first_seen[&prefix(n)], leaf_rank(n), n.clone()));
}

/// Trainable variables in module order with their names, then the other
/// variables sorted by name.
fn named_state(vs: &nn::VarStore) -> (Named, Named) {
    let named = vs.variables();
    let mut by_ptr: HashMap<usize, String> = named
        .iter()
        .map(|(n, t)| (t.data_ptr() as usize, n.clone()))
        .collect();
    let mut params = Vec::new();
    for t in vs.trainable_variables() {
        if let Some(name) = by_ptr.remove(&(t.data_ptr() as usize)) {
            params.push((name, t));
        }
    }
    order_like_pytorch(&mut params);
    let mut buffers: Vec<(String, Tensor)> = named
        .into_iter()
        .filter(|(_, t)| by_ptr.contains_key(&(t.data_ptr() as usize)))
        .collect();
    buffers.sort_by(|a, b| a.0.cmp(&b.0));
    (params, buffers)
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn caught_panics_keep_libtorch_s_first_line() {
        let p: Box<dyn std::any::Any + Send> = Box::new(String::from(
            "called `Result::unwrap()` on an `Err` value: Torch(\"Dimension out of range \
             (expected to be in range of [-1, 0], but got 1)\\nException raised from \
             maybe_wrap_dim_slow\\nframe #0: c10::Error::Error\")",
        ));
        assert_eq!(
            panic_text(&*p),
            "Dimension out of range (expected to be in range of [-1, 0], but got 1)"
        );
        let p: Box<dyn std::any::Any + Send> = Box::new("plain");
        assert_eq!(panic_text(&*p), "plain");
    }

    #[test]
    fn long_name_lists_are_cut() {
        assert_eq!(some_names(&["a", "b"]), r#"["a", "b"]"#);
        assert_eq!(
            some_names(&["a", "b", "c", "d", "e"]),
            r#"["a", "b", "c"] and 2 more"#
        );
    }
}
