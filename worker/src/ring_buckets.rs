//! The ring's bucketed all-reduce as the worker calls it: stages that fail
//! with the worker's [`Error`]. It lives above both the ring (which knows
//! only its own `CommError`) and the error module (which wraps it), so
//! neither reaches up to the other.

use crate::collective::BucketCopy;
use crate::comm::TcpRing;
use crate::error::Error;

impl TcpRing {
    /// Reduces `buckets` in place, in order, on the communication thread,
    /// without copying them: every bucket is staged in (`stage_in`) and
    /// queued as soon as it is ready, so staging bucket i + 1 overlaps the
    /// reduction of bucket i, and `stage_out(i)` overlaps bucket i + 1.
    pub fn all_reduce_buckets(
        &mut self,
        buckets: &mut [&mut [f32]],
        stage_in: BucketCopy<'_, Error>,
        stage_out: BucketCopy<'_, Error>,
    ) -> Result<(), Error> {
        self.buckets_with(buckets, stage_in, stage_out, Error::from)
    }
}
