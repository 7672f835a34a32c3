//! Which coordinator answers: in embedded mode always this one; in etcd
//! mode only the elected leader, while a follower answers every call with
//! the leader's address (gRPC UNAVAILABLE with the
//! `accrue_proto::layout::LEADER_HEADER` header; HTTP 503 with the address in the body).

use crate::error::CoordError;
use crate::service::Coordinator;
use std::sync::atomic::{AtomicBool, Ordering};
use std::sync::{Arc, RwLock};

#[derive(Default)]
pub struct Gate {
    current: RwLock<Option<Arc<Coordinator>>>,
    leader_addr: RwLock<String>,
    /// False while the membership/state backend (etcd) is unreachable.
    backend_ok: AtomicBool,
}

impl Gate {
    pub fn leading(c: Arc<Coordinator>) -> Arc<Self> {
        let g = Self::follower();
        g.lead(c);
        g
    }

    pub fn follower() -> Arc<Self> {
        let g = Self::default();
        g.backend_ok.store(true, Ordering::SeqCst);
        Arc::new(g)
    }

    pub fn lead(&self, c: Arc<Coordinator>) {
        *self.current.write().unwrap_or_else(|p| p.into_inner()) = Some(c);
    }

    pub fn set_leader_addr(&self, addr: &str) {
        *self.leader_addr.write().unwrap_or_else(|p| p.into_inner()) = addr.to_string();
    }

    pub fn leader_addr(&self) -> String {
        self.leader_addr
            .read()
            .unwrap_or_else(|p| p.into_inner())
            .clone()
    }

    pub fn set_backend_ok(&self, ok: bool) {
        self.backend_ok.store(ok, Ordering::SeqCst);
    }

    /// The coordinator, when this process leads.
    pub fn coordinator(&self) -> Option<Arc<Coordinator>> {
        self.current
            .read()
            .unwrap_or_else(|p| p.into_inner())
            .clone()
    }

    /// Why this process cannot serve, in words (None: it can).
    pub fn not_ready(&self) -> Option<String> {
        match self.coordinator() {
            None => {
                let leader = self.leader_addr();
                Some(if leader.is_empty() {
                    "no leader elected yet".into()
                } else {
                    format!("this replica follows; the leader is at {leader}")
                })
            }
            Some(c) => {
                if !self.backend_ok.load(Ordering::SeqCst) {
                    return Some("etcd is unreachable".into());
                }
                c.store_health().err()
            }
        }
    }

    /// Stops leading: this replica answers as a follower at once; the
    /// coordinator is returned for the caller to close (off the async
    /// runtime: closing joins the store's writer thread), after which it
    /// decides and writes nothing and its worker streams are closed (the
    /// daemons re-attach to whoever leads next).
    pub fn step_down(&self) -> Option<Arc<Coordinator>> {
        let c = self
            .current
            .write()
            .unwrap_or_else(|p| p.into_inner())
            .take();
        self.set_leader_addr("");
        c
    }

    /// The coordinator, or NotLeader naming the leader when one is known.
    pub fn get(&self) -> Result<Arc<Coordinator>, CoordError> {
        match self.coordinator() {
            Some(c) if !c.is_closed() => Ok(c),
            _ => {
                let leader = self.leader_addr();
                Err(CoordError::NotLeader {
                    leader: (!leader.is_empty()).then_some(leader),
                })
            }
        }
    }
}
