//! The outbox: what a dead attach stream could not take, kept for the next.

use accrue_proto::v1::{worker_message, WorkerMessage};
use std::collections::VecDeque;
use tokio::sync::mpsc;

/// How many unsent messages the outbox keeps at most.
pub(super) const OUTBOX_CAP: usize = 4096;

/// The messages an attach stream refused because it had died (a
/// `SendError` hands the message back), kept for the next stream, where
/// they go first after the hello and in their order. Bounded: past
/// [`OUTBOX_CAP`] the oldest step reports are dropped, never a JobDone or
/// an Interrupted (which the coordinator's decisions wait on).
#[derive(Debug, Default)]
pub(super) struct Outbox {
    unsent: VecDeque<WorkerMessage>,
}

impl Outbox {
    /// Sends `m` after everything kept before it. False when the stream is
    /// gone; then `m` (and whatever could not go before it) is kept.
    pub(super) fn send(
        &mut self,
        tx: &mpsc::UnboundedSender<WorkerMessage>,
        m: WorkerMessage,
    ) -> bool {
        self.unsent.push_back(m);
        self.flush(tx)
    }

    /// Sends the kept messages in order; false (keeping the rest, the one
    /// that failed first) when the stream is gone.
    pub(super) fn flush(&mut self, tx: &mpsc::UnboundedSender<WorkerMessage>) -> bool {
        while let Some(m) = self.unsent.pop_front() {
            if let Err(mpsc::error::SendError(m)) = tx.send(m) {
                self.unsent.push_front(m);
                self.trim();
                return false;
            }
        }
        true
    }

    fn trim(&mut self) {
        while self.unsent.len() > OUTBOX_CAP {
            let droppable = self.unsent.iter().position(|m| {
                matches!(
                    m.msg,
                    Some(worker_message::Msg::Step(_) | worker_message::Msg::Heartbeat(_))
                )
            });
            let Some(i) = droppable else { break };
            self.unsent.remove(i);
            tracing::warn!(
                cap = OUTBOX_CAP,
                "outbox full: dropped the oldest unsent step report"
            );
        }
    }

    pub(super) fn len(&self) -> usize {
        self.unsent.len()
    }
}
