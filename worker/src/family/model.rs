//! Models with PyTorch parameter names: `mlp` (torch.nn.Sequential of Linear
//! and ReLU: `0.weight`, `0.bias`, `2.weight`, ...), `lenet5` (conv1, conv2,
//! fc1..fc3), `resnet18`/`resnet34` (torchvision names), `torchscript`
//! (a module saved with torch.jit.save, trained through libtorch) and
//! `llama` (Hugging Face LlamaForCausalLM's names).

use crate::error::{torch_text, Error, Result, TorchContext};
use crate::family::tensor::{take, TensorPlace, TpSlice};
use crate::family::{Built, Headed};
use crate::spec::{ModelKind, ModelSpec};
use std::collections::{HashMap, HashSet};
use std::path::Path;
use std::sync::Mutex;
use tch::nn::{self, ModuleT};
use tch::{CModule, Device, Kind, Tensor};

/// Model construction draws from libtorch's process-global generator; this
/// lock plus a re-seed makes the initial weights a function of the job seed
/// even when several engines start at once (tests run on many threads).
static INIT_LOCK: Mutex<()> = Mutex::new(());

/// Tensors by PyTorch name.
pub use crate::family::Named;

pub use super::load::WeightsFrom;
pub use super::stage_build::{made, Keep, Take};

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
    Headed(Box<dyn Headed>),
    Staged(Box<dyn crate::family::StagedLayers>),
    Script(CModule),
}

/// What runs a forward pass: built-in layers (either kind) or a script.
enum Run<'a> {
    Layers(&'a dyn ModuleT),
    Script(&'a CModule),
}

impl Net {
    fn run(&self) -> Run<'_> {
        match self {
            Net::Builtin(m) => Run::Layers(&**m),
            Net::Headed(m) => Run::Layers(&**m),
            Net::Staged(m) => Run::Layers(&**m),
            Net::Script(m) => Run::Script(m),
        }
    }
}

/// A model with its parameters and buffers listed by PyTorch name.
pub struct Model {
    /// Keeps the built-in layers' variables alive.
    _vs: Option<nn::VarStore>,
    net: Net,
    /// Trainable parameters, in creation order (the order buckets use).
    pub params: Named,
    /// Parameters another pipeline stage trains (issue 40,
    /// [`Model::restrict`]): their names and shapes, so that loading checks
    /// the whole model; their storage is released.
    pub frozen: Vec<(String, Vec<i64>)>,
    /// Another stage's parameter this stage uses too (a tied embedding as
    /// the last stage's head): kept, with a gradient of its own, but
    /// trained by its owner, which sends the updated values back.
    pub shared: Named,
    /// Non-trainable state saved with the model (BatchNorm running stats).
    pub buffers: Named,
    pub kind: ModelKind,
    /// Tensor parallelism (issue 42, [`Model::split_tensor`]): this rank's
    /// slices; weights load whole and are cut by it.
    pub tensor_split: Option<ModelSplit>,
}

/// A model cut for tensor parallelism: this rank, each parameter's slice
/// and its whole shape.
#[derive(Clone, Debug)]
pub struct ModelSplit {
    pub rank: usize,
    pub slices: HashMap<String, TpSlice>,
    pub whole: HashMap<String, Vec<i64>>,
}

impl ModelSplit {
    /// The slice of a parameter, or of its optimizer state
    /// (`<param>.<state>` of the parameter's shape here): None for what is
    /// whole on every rank.
    pub fn slice_of(
        &self,
        name: &str,
        shape: &[i64],
        local: &HashMap<&str, Vec<i64>>,
    ) -> Option<&TpSlice> {
        let sliced = |s: &&TpSlice| !matches!(s, TpSlice::Replicated);
        if let Some(s) = self.slices.get(name).filter(sliced) {
            return Some(s);
        }
        let (param, _) = name.rsplit_once('.')?;
        let s = self.slices.get(param).filter(sliced)?;
        (local.get(param).map(|l| l.as_slice()) == Some(shape)
            || self.whole.get(param).map(|w| w.as_slice()) == Some(shape))
        .then_some(s)
    }
}

impl std::fmt::Debug for Model {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.debug_struct("Model")
            .field("kind", &self.kind)
            .field("params", &self.params.len())
            .finish()
    }
}

impl Model {
    /// Builds the model for inputs of `sample_shape` and `classes` outputs on
    /// `device` through its family (crate::family), seeded by `seed`, and
    /// checks one forward pass.
    pub fn build(
        spec: &ModelSpec,
        sample_shape: &[i64],
        classes: i64,
        device: Device,
        seed: u64,
    ) -> Result<Self> {
        let model = Self::make(spec, sample_shape, classes, device, seed, None, None)?;
        model.probe(sample_shape, classes, device)?;
        Ok(model)
    }

    /// The model as [`Model::build`] makes it (the same initial weights
    /// from `seed`), holding only the parameters `keep` names: each other
    /// parameter is released as soon as it is made and listed in
    /// [`Model::frozen`] by name and shape, so the build never holds more
    /// than the kept ones and one more (a pipeline stage, issue 40). With
    /// `keep` naming nothing, it gives every parameter's name and shape.
    /// The whole-model probe does not run (the stage cannot).
    pub fn build_stage(
        spec: &ModelSpec,
        sample_shape: &[i64],
        classes: i64,
        device: Device,
        seed: u64,
        keep: Keep,
    ) -> Result<Self> {
        let family = crate::family::family(spec.kind);
        if !family.draws_weights() || !family.builds_by_stage() {
            return Err(Error::Schedule(format!(
                "model.kind = {} does not build by pipeline stage",
                spec.kind
            )));
        }
        Self::make(spec, sample_shape, classes, device, seed, Some(keep), None)
    }

    /// ZeRO-3's build (issue 41): the model as [`Model::build`] makes it,
    /// but each parameter's values go to `take` as the family makes it
    /// and its storage is released at once (its shape kept), so no rank
    /// holds the whole model. The parameters' storage must be given back
    /// before anything reads them (engine/placement/params.rs).
    pub fn build_sharded(
        spec: &ModelSpec,
        sample_shape: &[i64],
        classes: i64,
        device: Device,
        seed: u64,
        take: Take,
    ) -> Result<Self> {
        let family = crate::family::family(spec.kind);
        if !family.draws_weights() || !family.builds_by_stage() {
            return Err(Error::Schedule(format!(
                "model.kind = {} does not build by block",
                spec.kind
            )));
        }
        Self::make(spec, sample_shape, classes, device, seed, None, Some(take))
    }

    /// The family's build, seeded under the initialisation lock where it
    /// draws weights; with `keep`, as [`Model::build_stage`] describes.
    fn make(
        spec: &ModelSpec,
        sample_shape: &[i64],
        classes: i64,
        device: Device,
        seed: u64,
        keep: Option<Keep>,
        take: Option<Take>,
    ) -> Result<Self> {
        let family = crate::family::family(spec.kind);
        let vs = nn::VarStore::new(device);
        let root = vs.root();
        let to = crate::family::BuildTo {
            spec,
            root: &root,
            shape: sample_shape,
            classes,
        };
        let (built, released) = if family.draws_weights() {
            let _guard = INIT_LOCK
                .lock()
                .unwrap_or_else(|poisoned| poisoned.into_inner());
            tch::manual_seed(seed as i64);
            let (built, released) = super::stage_build::during(keep, || {
                super::stage_build::sharding(take, || family.build(&to))
            });
            (built?, released)
        } else {
            (family.build(&to)?, Vec::new())
        };
        let mut model = match built {
            Built::Layers(net) => Self::of_layers(vs, Net::Builtin(net), spec.kind),
            Built::Headed(net) => Self::of_layers(vs, Net::Headed(net), spec.kind),
            Built::Staged(net) => Self::of_layers(vs, Net::Staged(net), spec.kind),
            Built::Script(module, params) => {
                let model = Self {
                    _vs: None,
                    net: Net::Script(module),
                    params,
                    frozen: Vec::new(),
                    shared: Vec::new(),
                    buffers: Vec::new(),
                    kind: spec.kind,
                    tensor_split: None,
                };
                let path = spec.path.clone().unwrap_or_default();
                model.probe_gradients(&path, sample_shape, device)?;
                model
            }
        };
        if !released.is_empty() {
            let gone: HashSet<&str> = released.iter().map(|(n, _)| n.as_str()).collect();
            model.params.retain(|(n, _)| !gone.contains(n.as_str()));
            model.frozen = released;
        }
        Ok(model)
    }

    /// Built-in layers with their variables.
    fn of_layers(vs: nn::VarStore, net: Net, kind: ModelKind) -> Self {
        let (params, buffers) = named_state(&vs);
        Self {
            _vs: Some(vs),
            net,
            params,
            frozen: Vec::new(),
            shared: Vec::new(),
            buffers,
            kind,
            tensor_split: None,
        }
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
        let out = tch::with_grad(|| m.forward_ts(&[&x])).map_err(|e| Error::ModelInput {
            model: "torchscript module".into(),
            reason: format!(
                "cannot take samples of shape {shape:?}: {}",
                torch_text("probing the TorchScript module", &e)
            ),
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
        let family = crate::family::family(self.kind);
        let x = family.probe_input(shape, device)?;
        let _guard = tch::no_grad_guard();
        let out = match self.net.run() {
            Run::Layers(m) => {
                std::panic::catch_unwind(std::panic::AssertUnwindSafe(|| m.forward_t(&x, false)))
                    .map_err(|p| Error::ModelInput {
                        model: self.kind.to_string(),
                        reason: format!(
                            "cannot take samples of shape {shape:?}: {}",
                            panic_text(&*p)
                        ),
                    })?
            }
            Run::Script(m) => m.forward_ts(&[&x]).map_err(|e| Error::ModelInput {
                model: "torchscript module".into(),
                reason: format!(
                    "cannot take samples of shape {shape:?}: {}",
                    torch_text("probing the TorchScript module", &e)
                ),
            })?,
        };
        family.check_output(self.kind, shape, &out.size(), classes)
    }

    pub fn forward(&self, xs: &Tensor, train: bool) -> Result<Tensor> {
        match self.net.run() {
            // tch's layers use panicking ops: a libtorch failure (out of
            // memory, say) becomes an error of the job, not a panic of its
            // thread.
            Run::Layers(m) => {
                std::panic::catch_unwind(std::panic::AssertUnwindSafe(|| m.forward_t(xs, train)))
                    .map_err(|p| {
                        let message = panic_text(&*p);
                        if crate::error::tensor_group_failed(&message) {
                            // A lost peer of the tensor group (issue 42).
                            return Error::Interrupted(format!(
                                "running the model's forward pass: {message}"
                            ));
                        }
                        Error::Torch {
                            context: "running the model's forward pass",
                            message,
                        }
                    })
            }
            Run::Script(m) => m.forward_ts(&[xs]).ctx("running the TorchScript module"),
        }
    }

    /// The model as layers with a linear head over features, where it is
    /// one (a language model): the training step may then compute the
    /// head with its loss in one pass.
    pub fn headed(&self) -> Option<&dyn Headed> {
        match &self.net {
            Net::Headed(m) => Some(&**m),
            _ => None,
        }
    }

    /// The model as pipeline stages, where it runs in stages (issue 40).
    pub fn staged(&self) -> Option<&dyn crate::family::Staged> {
        match &self.net {
            Net::Headed(m) => Some(&**m as &dyn crate::family::Staged),
            Net::Staged(m) => Some(&**m as &dyn crate::family::Staged),
            _ => None,
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

    /// Every tensor's name and shape: the state's and the frozen ones'
    /// (whole ones under tensor parallelism: what files hold).
    pub(super) fn shapes(&self) -> Vec<(&str, Vec<i64>)> {
        let whole = |n: &str, t: &Tensor| {
            self.tensor_split
                .as_ref()
                .and_then(|s| s.whole.get(n).cloned())
                .unwrap_or_else(|| t.size())
        };
        self.params
            .iter()
            .map(|(n, t)| (n.as_str(), whole(n, t)))
            .chain(self.frozen.iter().map(|(n, s)| (n.as_str(), s.clone())))
            .chain(self.shared.iter().map(|(n, t)| (n.as_str(), whole(n, t))))
            .chain(self.buffers.iter().map(|(n, t)| (n.as_str(), t.size())))
            .collect()
    }

    /// Keeps `names` as the trainable parameters (a pipeline stage's, in
    /// the model's order) and releases the rest: their storage is freed
    /// (the stage never runs their layers) and [`Model::frozen`] keeps
    /// their names and shapes, so that a checkpoint of the whole model
    /// still loads (each stage taking its own).
    pub fn restrict(&mut self, names: &HashSet<String>, shared: Option<&str>) -> Result<()> {
        let all = std::mem::take(&mut self.params);
        for (name, t) in all {
            if names.contains(&name) {
                self.params.push((name, t));
            } else if shared == Some(name.as_str()) {
                self.shared.push((name, t));
            } else {
                let shape = t.size();
                let mut t = t.set_requires_grad(false);
                let empty = Tensor::f_empty([0], (t.kind(), t.device()))
                    .ctx("releasing another stage's parameter")?;
                t.f_set_data(&empty)
                    .ctx("releasing another stage's parameter")?;
                self.frozen.push((name, shape));
            }
        }
        Ok(())
    }

    /// Tensor parallelism (issue 42): keeps this rank's slice of each
    /// parameter (`layout`: every parameter's, family/tensor.rs) of the
    /// whole values the build drew, then the network takes its geometry.
    pub fn split_tensor(
        &mut self,
        layout: &[(String, TpSlice)],
        place: &TensorPlace,
    ) -> Result<()> {
        let slices: HashMap<String, TpSlice> = layout.iter().cloned().collect();
        let mut whole = HashMap::new();
        {
            let _guard = tch::no_grad_guard();
            for (name, t) in self.params.iter().chain(self.shared.iter()) {
                let slice = slices.get(name).ok_or_else(|| {
                    Error::Sharding(format!("the tensor-parallel layout has no {name}"))
                })?;
                whole.insert(name.clone(), t.size());
                if matches!(slice, TpSlice::Replicated) {
                    continue;
                }
                let part = take(t, slice, place.rank)
                    .ctx("cutting the parameters for tensor parallelism")?;
                let mut t = t.shallow_clone();
                t.f_set_data(&part)
                    .ctx("cutting the parameters for tensor parallelism")?;
                // A gradient defined before (a pipeline's tied copy) takes
                // the slice's shape.
                if t.grad().defined() {
                    let zeros = part
                        .f_zeros_like()
                        .ctx("cutting the parameters for tensor parallelism")?;
                    crate::storage::set_grad(&t, &zeros)
                        .ctx("cutting the parameters for tensor parallelism")?;
                }
            }
        }
        match &mut self.net {
            Net::Headed(h) => h.split_tensor(place)?,
            _ => {
                return Err(Error::Schedule(format!(
                    "model.kind = {} has no tensor-parallel forward",
                    self.kind
                )))
            }
        }
        self.tensor_split = Some(ModelSplit {
            rank: place.rank,
            slices,
            whole,
        });
        Ok(())
    }

    pub fn grads(&self) -> Vec<Tensor> {
        self.params.iter().map(|(_, p)| p.grad()).collect()
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

    /// Issue 40: a stage build holds only what it keeps, and what it keeps
    /// is the whole build's values bit for bit (the generator drew every
    /// parameter in the same order); a build keeping nothing lists every
    /// parameter's name and shape, as the whole model has them. The mlp
    /// and a tied Llama.
    #[test]
    fn a_stage_build_keeps_its_parameters_with_the_whole_builds_values() {
        let llama = "kind = \"llama\"\nvocab_size = 32\nhidden_size = 16\nintermediate_size = 32\n\
                     num_hidden_layers = 2\nnum_attention_heads = 2\nmax_position_embeddings = 8\n\
                     tie_word_embeddings = true";
        for (text, shape, classes, keep) in [
            (
                "kind = \"mlp\"\nhidden = [8, 6]",
                vec![4i64],
                3i64,
                vec!["2.weight", "4.bias"],
            ),
            (
                llama,
                vec![8],
                32,
                vec![
                    "model.embed_tokens.weight",
                    "model.layers.1.mlp.up_proj.weight",
                ],
            ),
        ] {
            let spec: ModelSpec = toml::from_str(text).unwrap();
            let whole = Model::build(&spec, &shape, classes, Device::Cpu, 7).unwrap();
            let all =
                Model::build_stage(&spec, &shape, classes, Device::Cpu, 7, Box::new(|_| false))
                    .unwrap();
            assert!(all.params.is_empty());
            let listed: Vec<(String, Vec<i64>)> = whole
                .params
                .iter()
                .map(|(n, t)| (n.clone(), t.size()))
                .collect();
            let mut frozen = all.frozen.clone();
            frozen.sort();
            let mut listed_sorted = listed.clone();
            listed_sorted.sort();
            assert_eq!(frozen, listed_sorted, "{text}");
            let names: HashSet<String> = keep.iter().map(|s| s.to_string()).collect();
            let stage = Model::build_stage(
                &spec,
                &shape,
                classes,
                Device::Cpu,
                7,
                Box::new(move |n| names.contains(n)),
            )
            .unwrap();
            let mut held: Vec<&str> = stage.params.iter().map(|(n, _)| n.as_str()).collect();
            held.sort();
            let mut want = keep.clone();
            want.sort();
            assert_eq!(held, want, "{text}");
            for (n, t) in &stage.params {
                let w = &whole.params.iter().find(|(m, _)| m == n).unwrap().1;
                assert!(t.equal(w), "{n} differs from the whole build's");
            }
            assert_eq!(stage.frozen.len(), whole.params.len() - keep.len());
            // The released ones hold no storage in the layers.
            let vars = stage._vs.as_ref().unwrap().variables();
            for (n, _) in &stage.frozen {
                assert_eq!(vars[n].numel(), 0, "{n}");
            }
        }
    }

    /// Issue 40: a pipeline stage keeps its parameters and releases the
    /// others' storage, and the whole model's tensors still load into it
    /// by name (its own copied, the others' checked for shape and skipped).
    #[test]
    fn a_stage_releases_the_other_stages_parameters_and_loads_a_whole_model() {
        let spec: ModelSpec = toml::from_str("kind = \"mlp\"\nhidden = [8, 6]").unwrap();
        let whole = Model::build(&spec, &[4], 3, Device::Cpu, 1).unwrap();
        let saved: Named = whole
            .state()
            .map(|(n, t)| (n.clone(), t.copy() + 1.0))
            .collect();
        let mut m = Model::build(&spec, &[4], 3, Device::Cpu, 1).unwrap();
        let mine: HashSet<String> = ["2.weight", "2.bias"].map(String::from).into();
        m.restrict(&mine, None).unwrap();
        let kept: Vec<&str> = m.params.iter().map(|(n, _)| n.as_str()).collect();
        assert_eq!(kept, ["2.weight", "2.bias"]);
        assert_eq!(m.frozen.len(), 4);
        assert_eq!(m.frozen[0], ("0.weight".to_string(), vec![8, 4]));
        // The storage is gone from the layers themselves.
        let vars = m._vs.as_ref().unwrap().variables();
        assert_eq!(vars["0.weight"].numel(), 0);
        assert_eq!(vars["2.weight"].numel(), 48);
        let copy = |v: &Named| -> Named { v.iter().map(|(n, t)| (n.clone(), t.copy())).collect() };
        m.load_named(WeightsFrom::Checkpoint(Path::new("ck")), copy(&saved))
            .unwrap();
        let want = &saved.iter().find(|(n, _)| n == "2.weight").unwrap().1;
        assert!(m.params[0].1.equal(want));
        // A frozen tensor of the wrong shape is still refused by name.
        let mut bad = saved;
        bad[0].1 = Tensor::zeros([8, 5], (Kind::Float, Device::Cpu));
        let e = m
            .load_named(WeightsFrom::Checkpoint(Path::new("ck")), bad)
            .unwrap_err()
            .to_string();
        assert!(
            e.contains("0.weight: checkpoint [8, 5], model [8, 4]"),
            "{e}"
        );
    }

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
}
