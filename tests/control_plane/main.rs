//! The control plane end to end: an in-process coordinator on port 0, real
//! worker daemon processes, real gRPC and HTTP over sockets.

#[path = "../common/mod.rs"]
mod common;

use accrue_proto::v1::{self, job_event, JobState};
use common::*;
use std::time::Duration;
use tempfile::TempDir;

mod lifecycle;
mod limits;
mod refusals;
