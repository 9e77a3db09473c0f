//! Frame parsing used by interception: whatever the bytes, `unary_message`
//! returns an error or a message that re-frames to the same bytes, and the
//! replication policy's decoders never panic on it; nor does the
//! `Content.Write` watch's head reader on any bytes.
#![no_main]

use bytes::Bytes;
use imgbridge::proxy::grpc;
use libfuzzer_sys::fuzz_target;
use prost::Message;

fuzz_target!(|data: &[u8]| {
    // The watch of Content.Write reads the head of any request message:
    // whatever the bytes, it finds at most what is there.
    let head = imgbridge::replicate::commit::head(data);
    if let Some(e) = head.expected {
        assert!(e.len() <= data.len());
    }
    let body = Bytes::copy_from_slice(data);
    if let Ok(msg) = grpc::unary_message(&body) {
        // Re-framed by hand (`grpc::frame` lives with the tests that use it).
        let mut framed = vec![0u8];
        framed.extend_from_slice(&(msg.len() as u32).to_be_bytes());
        framed.extend_from_slice(&msg);
        assert_eq!(framed, body, "a parsed frame must re-frame identically");
        let _ = containerd_client::services::v1::CreateImageResponse::decode(msg.clone());
        let _ = containerd_client::services::v1::UpdateImageResponse::decode(msg.clone());
        let _ = containerd_client::services::v1::TransferRequest::decode(msg);
    }
    let _ = imgbridge::replicate::tree::parse(data);
});
