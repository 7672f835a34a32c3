//! The daemon's probe endpoint (`accrue-worker daemon --health-listen
//! ADDR`): plain HTTP, because a kubelet's probes cannot present a client
//! certificate, and so nothing in an answer is secret (a state and the
//! coordinator's address).
//!
//! - `GET /healthz`: 200 `ok` while the daemon's loop turns (it records a
//!   turn at least once per heartbeat when attached and once per retry when
//!   not; every wait in between is bounded), 503 once it has not turned for
//!   `stale_after` (a wedged loop: the kubelet restarts the pod).
//! - `GET /readyz`: 200 while attached to a coordinator, else 503 naming
//!   why (connecting, refused, the stream ended, shutting down).
//!
//! The decision is [`answer`], a pure function of the path, the state and
//! the time; [`serve`] is a thin axum shell around it.

use std::sync::{Arc, Mutex};
use std::time::{Duration, Instant};

/// Where the daemon stands with its coordinator.
#[derive(Clone, Debug, PartialEq, Eq)]
pub enum Link {
    /// Started, no attach tried yet.
    Starting,
    /// Cannot reach the coordinator (or set up the connection).
    Connecting { coordinator: String, error: String },
    /// Reached it, but the attach was refused (not the leader, a
    /// certificate naming another worker, ...).
    Refused { coordinator: String, reason: String },
    /// Attached: the coordinator may assign jobs to this worker.
    Attached { coordinator: String },
    /// The attach stream ended; re-attaching.
    Lost { coordinator: String, reason: String },
    /// Told to stop (SIGTERM): detaching.
    Stopping,
}

/// The state the daemon's loop keeps up to date.
#[derive(Clone, Debug)]
pub struct Health {
    pub link: Link,
    /// The last time the loop turned.
    pub last_turn: Instant,
}

impl Health {
    pub fn new(now: Instant) -> Self {
        Self {
            link: Link::Starting,
            last_turn: now,
        }
    }
}

/// `/healthz` turns 503 when the loop has not turned for this long: ten
/// heartbeats, and never less than a minute (a connection attempt takes up
/// to [`super::CONNECT_TIMEOUT`] + [`super::ATTACH_TIMEOUT`]).
pub fn stale_after(heartbeat: Duration) -> Duration {
    (heartbeat * 10).max(Duration::from_secs(60))
}

/// The answer to `GET path`: status code and body (one line of text).
pub fn answer(path: &str, h: &Health, now: Instant, stale_after: Duration) -> (u16, String) {
    match path {
        "/healthz" => {
            let quiet = now.saturating_duration_since(h.last_turn);
            if quiet > stale_after {
                (
                    503,
                    format!(
                        "the daemon's loop has not turned for {:.0} s (limit {:.0} s)",
                        quiet.as_secs_f64(),
                        stale_after.as_secs_f64()
                    ),
                )
            } else {
                (200, "ok".into())
            }
        }
        "/readyz" => match &h.link {
            Link::Attached { coordinator } => (200, format!("attached to {coordinator}")),
            Link::Starting => (503, "starting: not attached yet".into()),
            Link::Connecting { coordinator, error } => (
                503,
                format!("connecting: cannot reach the coordinator at {coordinator}: {error}"),
            ),
            Link::Refused {
                coordinator,
                reason,
            } => (
                503,
                format!("refused: the coordinator at {coordinator} refused the attach: {reason}"),
            ),
            Link::Lost {
                coordinator,
                reason,
            } => (
                503,
                format!("re-attaching: the stream to {coordinator} ended: {reason}"),
            ),
            Link::Stopping => (503, "stopping: detaching from the coordinator".into()),
        },
        _ => (404, "not found: /healthz and /readyz only".into()),
    }
}

/// The daemon's handle on its [`Health`] (shared with the server).
#[derive(Clone, Debug)]
pub struct HealthState(Arc<Mutex<Health>>);

impl Default for HealthState {
    fn default() -> Self {
        Self(Arc::new(Mutex::new(Health::new(Instant::now()))))
    }
}

impl HealthState {
    fn lock(&self) -> std::sync::MutexGuard<'_, Health> {
        self.0.lock().unwrap_or_else(|p| p.into_inner())
    }

    /// The loop turned.
    pub fn turn(&self) {
        self.lock().last_turn = Instant::now();
    }

    /// The loop turned, and the link is now `link` (logged when it changes
    /// from one kind to another).
    pub fn set(&self, link: Link) {
        let mut h = self.lock();
        h.last_turn = Instant::now();
        if std::mem::discriminant(&h.link) != std::mem::discriminant(&link) {
            tracing::debug!(?link, "readiness changed");
        }
        h.link = link;
    }

    /// A copy of the state now.
    pub fn get(&self) -> Health {
        self.lock().clone()
    }
}

/// Serves `/healthz` and `/readyz` on `listener` (plain HTTP) until the
/// process ends.
pub async fn serve(
    listener: tokio::net::TcpListener,
    state: HealthState,
    stale_after: Duration,
) -> std::io::Result<()> {
    let app = axum::Router::new().fallback(move |uri: axum::http::Uri| {
        let state = state.clone();
        async move {
            let (code, body) = answer(uri.path(), &state.get(), Instant::now(), stale_after);
            let code = axum::http::StatusCode::from_u16(code)
                .unwrap_or(axum::http::StatusCode::INTERNAL_SERVER_ERROR);
            (
                code,
                [(axum::http::header::CACHE_CONTROL, "no-store")],
                format!("{body}\n"),
            )
        }
    });
    axum::serve(listener, app).await
}

#[cfg(test)]
mod tests {
    use super::*;

    const STALE: Duration = Duration::from_secs(60);

    fn at(link: Link, t0: Instant) -> Health {
        Health {
            link,
            last_turn: t0,
        }
    }

    #[test]
    fn healthz_follows_the_loop_not_the_coordinator() {
        let t0 = Instant::now();
        for link in [
            Link::Starting,
            Link::Refused {
                coordinator: "c:1".into(),
                reason: "not the leader".into(),
            },
            Link::Attached {
                coordinator: "c:1".into(),
            },
        ] {
            let h = at(link, t0);
            assert_eq!(answer("/healthz", &h, t0, STALE), (200, "ok".into()));
            assert_eq!(
                answer("/healthz", &h, t0 + STALE, STALE),
                (200, "ok".into()),
                "the limit itself is still alive"
            );
            let (code, body) = answer("/healthz", &h, t0 + STALE + Duration::from_secs(1), STALE);
            assert_eq!(code, 503);
            assert_eq!(
                body,
                "the daemon's loop has not turned for 61 s (limit 60 s)"
            );
        }
        // A clock that went backwards (last_turn after now) is not stale.
        let h = at(Link::Starting, t0 + Duration::from_secs(5));
        assert_eq!(answer("/healthz", &h, t0, STALE).0, 200);
    }

    #[test]
    fn readyz_is_200_only_while_attached_and_names_the_reason_otherwise() {
        let t0 = Instant::now();
        let cases = [
            (
                Link::Attached {
                    coordinator: "https://coordinator:50051".into(),
                },
                200,
                "attached to https://coordinator:50051",
            ),
            (Link::Starting, 503, "starting: not attached yet"),
            (
                Link::Connecting {
                    coordinator: "https://coordinator:50051".into(),
                    error: "connection refused".into(),
                },
                503,
                "connecting: cannot reach the coordinator at https://coordinator:50051: connection refused",
            ),
            (
                Link::Refused {
                    coordinator: "https://c:1".into(),
                    reason: "not the leader; the leader is at x:1".into(),
                },
                503,
                "refused: the coordinator at https://c:1 refused the attach: not the leader; the leader is at x:1",
            ),
            (
                Link::Lost {
                    coordinator: "https://c:1".into(),
                    reason: "the coordinator closed the stream".into(),
                },
                503,
                "re-attaching: the stream to https://c:1 ended: the coordinator closed the stream",
            ),
            (
                Link::Stopping,
                503,
                "stopping: detaching from the coordinator",
            ),
        ];
        for (link, code, body) in cases {
            assert_eq!(
                answer("/readyz", &at(link.clone(), t0), t0, STALE),
                (code, body.to_string()),
                "{link:?}"
            );
        }
    }

    #[test]
    fn other_paths_are_404() {
        let h = at(Link::Starting, Instant::now());
        for p in ["/", "/metrics", "/healthz/", "/readyzz", "/v1/jobs"] {
            assert_eq!(answer(p, &h, h.last_turn, STALE).0, 404, "{p}");
        }
    }

    #[test]
    fn stale_after_is_ten_heartbeats_and_at_least_a_minute() {
        assert_eq!(stale_after(Duration::from_secs(1)), STALE);
        assert_eq!(stale_after(Duration::from_millis(200)), STALE);
        assert_eq!(
            stale_after(Duration::from_secs(30)),
            Duration::from_secs(300)
        );
    }

    #[test]
    fn set_records_a_turn_and_the_link() {
        let s = HealthState::default();
        let before = s.get().last_turn;
        std::thread::sleep(Duration::from_millis(5));
        s.set(Link::Attached {
            coordinator: "c:1".into(),
        });
        let h = s.get();
        assert!(h.last_turn > before);
        assert_eq!(
            h.link,
            Link::Attached {
                coordinator: "c:1".into()
            }
        );
    }
}
