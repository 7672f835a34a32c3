//! The gRPC codec of every accrue service and client: prost's, except
//! that a message that does not decode is INVALID_ARGUMENT (the sender's
//! fault) rather than tonic-prost's INTERNAL (which would blame the
//! receiver). build.rs points the generated code here (`codec_path`).
//!
//! The codec cannot tell a server from a client (both decode with it): a
//! reply that does not decode is INVALID_ARGUMENT at the client too, its
//! message naming the type that did not decode. Only a peer that is not
//! accrue (or a corrupted stream) sends one.

use prost::Message;
use std::marker::PhantomData;
use tonic::codec::{BufferSettings, DecodeBuf, Decoder};
use tonic::Status;
use tonic_prost::{ProstCodec, ProstDecoder, ProstEncoder};

/// prost's codec with decode errors mapped by [`decode_error`].
#[derive(Debug, Clone)]
pub struct Codec<T, U>(PhantomData<(T, U)>);

impl<T, U> Default for Codec<T, U> {
    fn default() -> Self {
        Self(PhantomData)
    }
}

impl<T, U> tonic::codec::Codec for Codec<T, U>
where
    T: Message + Send + 'static,
    U: Message + Default + Send + 'static,
{
    type Encode = T;
    type Decode = U;
    type Encoder = ProstEncoder<T>;
    type Decoder = CheckedDecoder<U>;

    fn encoder(&mut self) -> Self::Encoder {
        ProstCodec::<T, U>::raw_encoder(BufferSettings::default())
    }

    fn decoder(&mut self) -> Self::Decoder {
        CheckedDecoder(ProstCodec::<T, U>::raw_decoder(BufferSettings::default()))
    }
}

/// prost's decoder; a message that does not decode is INVALID_ARGUMENT.
#[derive(Debug, Clone)]
pub struct CheckedDecoder<U>(ProstDecoder<U>);

impl<U: Message + Default> Decoder for CheckedDecoder<U> {
    type Item = U;
    type Error = Status;

    fn decode(&mut self, buf: &mut DecodeBuf<'_>) -> Result<Option<U>, Status> {
        self.0
            .decode(buf)
            .map_err(|s| decode_error::<U>(s.message()))
    }

    fn buffer_settings(&self) -> BufferSettings {
        self.0.buffer_settings()
    }
}

/// The status for bytes that do not decode as a `U`: INVALID_ARGUMENT
/// naming the message type and prost's reason.
pub fn decode_error<U>(reason: &str) -> Status {
    let full = std::any::type_name::<U>();
    let name = full.rsplit("::").next().unwrap_or(full);
    Status::invalid_argument(format!(
        "the {name} message does not decode as protobuf: {reason}"
    ))
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn a_decode_error_is_invalid_argument_naming_the_type() {
        let s = decode_error::<crate::v1::SubmitJobRequest>("invalid wire type");
        assert_eq!(s.code(), tonic::Code::InvalidArgument);
        assert_eq!(
            s.message(),
            "the SubmitJobRequest message does not decode as protobuf: invalid wire type"
        );
    }
}
