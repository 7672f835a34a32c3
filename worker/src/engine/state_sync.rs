//! Bringing every rank to the job's newest committed state when a
//! generation forms: the ranks agree on who holds the newest step, and that
//! rank broadcasts its parameters, buffers, optimizer state and counters as
//! bytes ([`Collective::broadcast_bytes`]).
//!
//! The state's bytes: the header's length (u64, little endian), the header
//! as JSON ([`StateHeader`]: counters, tensor names and shapes), then every
//! tensor's f32 values, little endian, in the header's order.

use super::flat::{flatten, unflatten};
use super::Engine;
use crate::checkpoint::TrainerState;
use crate::comm::collective::Collective;
use crate::error::{Error, Result, TorchContext};
use tch::{Kind, Tensor};

/// What the state's bytes hold before the tensor values.
#[derive(Clone, Debug, PartialEq, serde::Serialize, serde::Deserialize)]
pub(super) struct StateHeader {
    pub state: TrainerState,
    pub model: Vec<(String, Vec<i64>)>,
    pub optimizer: Vec<(String, Vec<i64>)>,
}

fn bad(reason: String) -> Error {
    Error::StateSync(reason)
}

/// The elements of a tensor of `shape`.
fn numel(shape: &[i64]) -> Result<usize> {
    shape
        .iter()
        .try_fold(1usize, |n, &d| {
            usize::try_from(d).ok().and_then(|d| n.checked_mul(d))
        })
        .ok_or_else(|| bad(format!("impossible tensor shape {shape:?}")))
}

/// The header, then the values: see the module documentation.
pub(super) fn encode_state(header: &StateHeader, values: &[f32]) -> Result<Vec<u8>> {
    let json = serde_json::to_vec(header).map_err(|e| bad(e.to_string()))?;
    let mut out = Vec::with_capacity(8 + json.len() + values.len() * 4);
    out.extend_from_slice(&(json.len() as u64).to_le_bytes());
    out.extend_from_slice(&json);
    for v in values {
        out.extend_from_slice(&v.to_le_bytes());
    }
    Ok(out)
}

/// Reads what [`encode_state`] wrote; the values must be exactly as many as
/// the header's shapes hold.
pub(super) fn decode_state(bytes: &[u8]) -> Result<(StateHeader, Vec<f32>)> {
    let (len, rest) = bytes
        .split_first_chunk::<8>()
        .ok_or_else(|| bad(format!("{} bytes, too short for a header", bytes.len())))?;
    let len = usize::try_from(u64::from_le_bytes(*len))
        .ok()
        .filter(|&n| n <= rest.len())
        .ok_or_else(|| {
            bad(format!(
                "header length {} beyond the {} bytes sent",
                u64::from_le_bytes(*len),
                rest.len()
            ))
        })?;
    let (json, values) = rest.split_at(len);
    let header: StateHeader = serde_json::from_slice(json).map_err(|e| bad(e.to_string()))?;
    let want = header
        .model
        .iter()
        .chain(&header.optimizer)
        .try_fold(0usize, |n, (_, s)| {
            Ok::<_, Error>(n.saturating_add(numel(s)?))
        })?;
    if values.len() != want.saturating_mul(4) {
        return Err(bad(format!(
            "{} bytes of tensor values, the header's shapes hold {want} f32 values",
            values.len()
        )));
    }
    let values = values
        .chunks_exact(4)
        .map(|c| f32::from_le_bytes([c[0], c[1], c[2], c[3]]))
        .collect();
    Ok((header, values))
}

/// Every rank's `mine` over the engine's collective (the data axis).
fn all_gather_u64(c: &mut impl Collective, mine: u64) -> Result<Vec<u64>> {
    Ok(crate::comm::collective::gather_u64(c, mine)?)
}

/// The rank holding the newest committed state: the highest value (lowest
/// rank on ties), and that value.
fn newest(steps: &[u64]) -> (usize, u64) {
    steps.iter().enumerate().fold(
        (0, 0),
        |(r, b), (i, &s)| if s > b { (i, s) } else { (r, b) },
    )
}

impl<C: Collective> Engine<C> {
    /// Makes every rank hold the newest committed state: the rank with the
    /// highest committed step (lowest rank on ties) broadcasts parameters,
    /// buffers, optimizer state and counters. With no committed state
    /// anywhere (a fresh start) rank 0's initial weights are broadcast.
    ///
    /// Pipeline stages (issue 40) do this inside each stage's data group
    /// (the stage's replicas), then [`Engine::sync_stages`] checks that
    /// every stage holds the same step.
    pub(super) fn sync_state(&mut self) -> Result<()> {
        // Under ZeRO-3 no rank can hand another its parameters.
        if self.placement.strategy.param_shards().is_some() {
            self.sync_zero3()?;
            // Every rank sharded (no collective), so that the stages'
            // exchanges gather on every data rank alike.
            self.shard_params()?;
        } else {
            self.sync_replicas()?;
        }
        // Stages and tensor ranks hold parts of one replica: every part
        // must be at the same step (or all roll back).
        if self.mesh.is_split() {
            self.sync_stages()?;
        }
        Ok(())
    }

    /// [`Engine::sync_state`] under ZeRO-3, where every rank holds only
    /// its slice of the parameters. Every rank at the same committed step
    /// with its slices in place (or whole parameters not yet sharded):
    /// nothing to move. A committed state some rank lost its slice of:
    /// every rank rolls back to the last checkpoint, as stages 1 and 2 do.
    /// Nothing committed anywhere but slices out of place (a rank lost
    /// before the first step): every rank builds the initial weights
    /// again, from the job's seed and `model.init`.
    fn sync_zero3(&mut self) -> Result<()> {
        if let Some(s) = self.placement.strategy.param_shards() {
            s.settle()?;
        }
        let layout = (self.collective.world_size(), self.collective.rank());
        let here = self
            .placement
            .strategy
            .param_shards()
            .is_none_or(|s| s.in_place(layout));
        let mine = if self.holds_committed {
            self.state.step + 1
        } else {
            0
        };
        let steps = all_gather_u64(&mut self.collective, mine)?;
        let (_, best) = newest(&steps);
        if best > 0 {
            return self.sync_sharded(&steps, best, here);
        }
        let placed = all_gather_u64(&mut self.collective, u64::from(here))?;
        if placed.iter().all(|&p| p == 1) {
            return Ok(());
        }
        tracing::warn!(
            rank = layout.1,
            "parameter shards out of place before the first step: every rank builds the initial weights again"
        );
        self.initial_params_again()
    }

    /// Pipeline stages: after each stage's replicas agreed, every stage of
    /// every replica must hold the same committed step. They do unless a
    /// stage lost every worker that held its state (a stage without data
    /// replicas, or all of them lost): then **every rank rolls back to the
    /// last checkpoint**, each stage taking its own tensors; with no
    /// common checkpoint the job fails naming the steps. Last, a tied
    /// embedding's head copy takes the first stage's values (a last stage
    /// that joined holds its initial weights there).
    fn sync_stages(&mut self) -> Result<()> {
        let mine = if self.holds_committed {
            self.state.step + 1
        } else {
            0
        };
        let steps = self.collective.world_gather_u64(mine)?;
        if steps.iter().any(|&s| s != mine) {
            let latest = crate::checkpoint::load_newest(&self.checkpoint_dir, &self.owner)?
                .map(|c| c.loaded.state.step);
            let at = self
                .collective
                .world_gather_u64(latest.map_or(0, |s| s + 1))?;
            let common = at
                .first()
                .copied()
                .filter(|&a| a > 0 && at.iter().all(|&x| x == a));
            let Some(first) = common else {
                return Err(Error::StateSync(format!(
                    "the stages of the re-formed pipeline hold different committed steps (step + 1 by rank, 0 for none: {steps:?}): a stage lost every worker that held its state, and there is no common checkpoint to roll back to (checkpoint steps + 1 by rank: {at:?}); set checkpoint.every_steps, or run data replicas of each stage"
                )));
            };
            tracing::warn!(
                rank = self.collective.rank(),
                steps = ?steps,
                checkpoint_step = first - 1,
                "a pipeline stage's state was lost with its workers: every rank rolls back to the last checkpoint"
            );
            if !self.resume()? {
                return Err(Error::Checkpoint {
                    path: self.checkpoint_dir.clone(),
                    reason: "the checkpoint to roll back to disappeared".into(),
                });
            }
        }
        self.pipeline_tied_values()
    }

    /// [`Engine::sync_state`] over the engine's collective (a stage's data
    /// group when the model is split).
    fn sync_replicas(&mut self) -> Result<()> {
        if self.collective.world_size() == 1 {
            // A sharded job shrunk to one rank holds half a state: it too
            // must roll back (or fail naming the lost shard).
            if !self.placement.strategy.holds_whole_state() && !self.shard_in_place() {
                let mine = self.state.step + 1;
                return self.sync_sharded(&[mine], mine, true);
            }
            return Ok(());
        }
        let rank = self.collective.rank();
        // Step + 1 for a rank holding committed state, 0 for fresh weights.
        let mine = if self.holds_committed {
            self.state.step + 1
        } else {
            0
        };
        let steps = all_gather_u64(&mut self.collective, mine)?;
        let (source, best) = newest(&steps);
        if best == 0 {
            return self.broadcast_state(0);
        }
        if !self.placement.strategy.holds_whole_state() {
            return self.sync_sharded(&steps, best, true);
        }
        let mut bytes = if rank == source {
            self.pack_state()?
        } else {
            Vec::new()
        };
        self.collective.broadcast_bytes(&mut bytes, source)?;
        if rank != source {
            self.unpack_state(&bytes)?;
            self.resumed_from = Some(format!("rank {source}'s state (step {})", self.state.step));
        }
        self.holds_committed = true;
        tracing::info!(
            source,
            step = self.state.step,
            bytes = bytes.len(),
            "state synchronised from rank {source}"
        );
        Ok(())
    }

    /// [`Engine::sync_state`] under sharding, where no rank holds the whole
    /// optimizer state to broadcast. Every rank holding the same committed
    /// step and its own slice's state in this ring (a resume): nothing to
    /// move. Otherwise (a lost rank took its shard along, or the slices
    /// moved with the world size) **every rank rolls back to the last
    /// checkpoint**, which holds the whole state; with none, the job fails
    /// naming the lost shard rather than going on without it.
    /// `params_here`: this rank's parameters are in place (ZeRO-3's slice
    /// at its place in the ring; always below stage 3).
    fn sync_sharded(&mut self, steps: &[u64], best: u64, params_here: bool) -> Result<()> {
        let mine = u64::from(self.shard_in_place() && params_here);
        let placed = all_gather_u64(&mut self.collective, mine)?;
        if steps.iter().all(|&s| s == best) && placed.iter().all(|&p| p == 1) {
            self.holds_committed = true;
            return Ok(());
        }
        let latest = crate::checkpoint::load_newest(&self.checkpoint_dir, &self.owner)?
            .map(|c| c.loaded.state.step);
        let at = all_gather_u64(&mut self.collective, latest.map_or(0, |s| s + 1))?;
        if let Some(&first) = at.first().filter(|&&a| a > 0 && at.iter().all(|&x| x == a)) {
            tracing::warn!(
                rank = self.collective.rank(),
                steps = ?steps,
                checkpoint_step = first - 1,
                "sharded optimizer state incomplete in the new ring: every rank rolls back to the last checkpoint"
            );
            if !self.resume()? {
                return Err(Error::Checkpoint {
                    path: self.checkpoint_dir.clone(),
                    reason: "the checkpoint to roll back to disappeared".into(),
                });
            }
            return Ok(());
        }
        Err(Error::Sharding(format!(
            "a re-formed ring of a job with sharding.stage = {} needs every rank's optimizer shard for its place in the new ring, and ranks hold committed steps {steps:?} with shards in place {placed:?} (a lost rank's shard is gone; shard replicas are not built yet) and no common checkpoint to roll back to (checkpoint steps + 1 by rank: {at:?}); set checkpoint.every_steps so a sharded job can recover",
            self.placement.strategy.stage()
        )))
    }

    /// Parameters, buffers, optimizer state and counters as bytes.
    fn pack_state(&self) -> Result<Vec<u8>> {
        let model = self.model_state();
        let opt = self.placement.optimizer.named_state(&self.model.params);
        let shapes = |ts: &[(String, Tensor)]| -> Result<Vec<(String, Vec<i64>)>> {
            ts.iter()
                .map(|(n, t)| {
                    if t.kind() != Kind::Float {
                        return Err(Error::StateSync(format!(
                            "{n} is {:?}; only float32 state can be synchronised between ranks",
                            t.kind()
                        )));
                    }
                    Ok((n.clone(), t.size()))
                })
                .collect()
        };
        let header = StateHeader {
            state: self.state.clone(),
            model: shapes(&model)?,
            optimizer: shapes(&opt)?,
        };
        let tensors: Vec<Tensor> = model
            .iter()
            .chain(opt.iter())
            .map(|(_, t)| t.shallow_clone())
            .collect();
        encode_state(&header, &flatten(&tensors)?)
    }

    fn unpack_state(&mut self, bytes: &[u8]) -> Result<()> {
        let (header, values) = decode_state(bytes)?;
        let mut data = &values[..];
        let mut take = |shape: &[i64]| -> Result<&[f32]> {
            // decode_state checked that the values are exactly the shapes'.
            let (a, b) = data.split_at(numel(shape)?.min(data.len()));
            data = b;
            Ok(a)
        };
        let mine: std::collections::HashMap<String, Tensor> = self
            .model
            .state()
            .map(|(n, t)| (n.clone(), t.shallow_clone()))
            .collect();
        let _guard = tch::no_grad_guard();
        for (name, shape) in &header.model {
            let t = mine
                .get(name)
                .ok_or_else(|| bad(format!("unknown tensor {name}")))?;
            if t.size() != *shape {
                return Err(bad(format!(
                    "{name} has shape {shape:?} at the source, {:?} here",
                    t.size()
                )));
            }
            unflatten(take(shape)?, std::slice::from_ref(t))?;
        }
        let mut opt = Vec::with_capacity(header.optimizer.len());
        for (name, shape) in &header.optimizer {
            let t = Tensor::f_from_slice(take(shape)?)
                .and_then(|t| t.f_view(shape.as_slice()))
                .ctx("rebuilding optimizer state")?;
            opt.push((name.clone(), t));
        }
        self.placement.optimizer.load_state(
            &self.model.params,
            opt,
            header.state.optimizer_steps,
        )?;
        self.state = header.state;
        Ok(())
    }

    /// Copies parameters and buffers from `root` to every rank (f32
    /// broadcast: every rank knows their sizes).
    fn broadcast_state(&mut self, root: usize) -> Result<()> {
        let tensors: Vec<Tensor> = self.model.state().map(|(_, t)| t.shallow_clone()).collect();
        let mut buf = flatten(&tensors)?;
        self.collective.broadcast(&mut buf, root)?;
        unflatten(&buf, &tensors)
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use crate::comm::collective::SingleRank;

    fn header() -> StateHeader {
        StateHeader {
            state: TrainerState {
                job: "j".into(),
                step: 12,
                samples_seen: 1 << 50,
                ..Default::default()
            },
            model: vec![("0.weight".into(), vec![2, 3]), ("0.bias".into(), vec![2])],
            optimizer: vec![("0.weight.momentum_buffer".into(), vec![2, 3])],
        }
    }

    #[test]
    fn state_bytes_round_trip_exactly() {
        let values: Vec<f32> = (0..12)
            .map(|i| f32::from_bits(0x3f80_0000 ^ (i * 0x1357)))
            .chain([f32::from_bits(0x7fc0_1234), -0.0])
            .collect();
        let bytes = encode_state(&header(), &values).unwrap();
        let (h, v) = decode_state(&bytes).unwrap();
        assert_eq!(h, header());
        // Bit for bit (NaN payloads and signed zeros included).
        let bits = |v: &[f32]| v.iter().map(|x| x.to_bits()).collect::<Vec<_>>();
        assert_eq!(bits(&v), bits(&values));
        // Counters beyond 2^48 survive (the old f32 header could not).
        assert_eq!(h.state.samples_seen, 1 << 50);
    }

    #[test]
    fn damaged_state_bytes_are_refused() {
        let bytes = encode_state(&header(), &[0.5; 14]).unwrap();
        for (cut, what) in [
            (bytes.len() - 1, "bytes of tensor values"),
            (20, "header length"),
            (3, "too short"),
        ] {
            let err = decode_state(&bytes[..cut]).unwrap_err().to_string();
            assert!(err.contains(what), "cut at {cut}: {err}");
        }
        let mut longer = bytes.clone();
        longer.extend_from_slice(&[0; 4]);
        let err = decode_state(&longer).unwrap_err().to_string();
        assert!(err.contains("60 bytes"), "{err}");
        // Too few values for the shapes.
        assert!(decode_state(&encode_state(&header(), &[0.5; 13]).unwrap()).is_err());
    }

    #[test]
    fn the_newest_state_wins_lowest_rank_on_ties() {
        assert_eq!(newest(&[0, 0, 0]), (0, 0));
        assert_eq!(newest(&[0, 5, 3]), (1, 5));
        assert_eq!(newest(&[7, 9, 9]), (1, 9));
        assert_eq!(newest(&[u64::MAX, 1]), (0, u64::MAX));
    }

    #[test]
    fn all_gather_on_one_rank_is_its_own_value() {
        assert_eq!(
            all_gather_u64(&mut SingleRank, 1 << 60).unwrap(),
            vec![1 << 60]
        );
    }
}
