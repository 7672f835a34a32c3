//! The ring's bucketed all-reduce as the worker calls it: stages that fail
//! with the worker's [`Error`]. It lives above both the ring (which knows
//! only its own `CommError`) and the error module (which wraps it), so
//! neither reaches up to the other.

use crate::comm::collective::BucketCopy;
use crate::comm::TcpRing;
use crate::error::Error;

impl TcpRing {
    /// Reduces `buckets` in place, in order, on the communication thread,
    /// without copying them: every bucket is staged in (`copy_in`) and
    /// queued as soon as it is ready, so staging bucket i + 1 overlaps the
    /// reduction of bucket i, and `copy_out(i)` overlaps bucket i + 1.
    pub fn all_reduce_buckets(
        &mut self,
        buckets: &mut [&mut [f32]],
        copy_in: BucketCopy<'_, Error>,
        copy_out: BucketCopy<'_, Error>,
    ) -> Result<(), Error> {
        self.buckets_with(buckets, copy_in, copy_out, Error::from)
    }
}
