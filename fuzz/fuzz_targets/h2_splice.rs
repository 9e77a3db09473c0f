//! The splice's HTTP/2 parsing: any bytes from the client (after the
//! preface) and from containerd, with every call intercepted, must end in a
//! clean result or error, never a panic or a hang; and the HPACK decoder
//! must survive any block under any table size limit.
//!
//! Seeds (`fuzz/seeds/h2_splice`; all but `held_create` and `pings` written
//! by `fuzz/gen_h2_seeds.py`): a held Create call; CONTINUATION floods and
//! blocks split into many frames; table size updates against
//! SETTINGS_HEADER_TABLE_SIZE before and after ACKs; a held reply larger
//! than the client's stream window; a request block the HPACK mirror cannot
//! decode; client PINGs around a held reply's release (the PINGs the splice
//! answers itself).
#![no_main]

use std::sync::{Arc, OnceLock};
use std::time::Duration;

use imgbridge::proxy::intercept::{typed, CallInfo, Hook, Interceptor};
use imgbridge::proxy::h2::{self as splice, frame as frames, hpack};
use libfuzzer_sys::fuzz_target;
use tokio::io::{AsyncReadExt, AsyncWriteExt};
use tokio::net::UnixStream;
use tokio_util::sync::CancellationToken;

struct HoldAll;

impl Interceptor for HoldAll {
    fn select(&self, _: &CallInfo) -> Option<Box<dyn Hook>> {
        Some(typed(|_: (), _: ()| async { Ok(()) }))
    }
}

fn rt() -> &'static tokio::runtime::Runtime {
    static RT: OnceLock<tokio::runtime::Runtime> = OnceLock::new();
    RT.get_or_init(|| {
        tokio::runtime::Builder::new_current_thread()
            .enable_all()
            .build()
            .unwrap()
    })
}

fuzz_target!(|data: &[u8]| {
    let mut d = hpack::Decoder::new(4096);
    if let [a, b, ..] = data {
        // As SETTINGS_HEADER_TABLE_SIZE would set it (0 to about 1 MiB).
        d.set_limit(u16::from_be_bytes([*a, *b]) as usize * 16);
    }
    let _ = d.decode(data, |_, _| {});
    let _ = d.decode(data, |_, _| {});

    // Input: u16 (big-endian) length of the client's bytes, client bytes,
    // containerd's bytes.
    let (from_client, from_server) = match data {
        [a, b, rest @ ..] => rest.split_at((u16::from_be_bytes([*a, *b]) as usize).min(rest.len())),
        _ => (&[][..], data),
    };
    rt().block_on(async {
        let (mut client, down) = UnixStream::pair().unwrap();
        let (up, mut server) = UnixStream::pair().unwrap();
        let ctx = Arc::new(splice::Ctx {
            interceptor: Arc::new(HoldAll),
            observer: None,
            upstream: "/fuzz/containerd.sock".into(),
        });
        let task = tokio::spawn(splice::run(down, up, ctx, CancellationToken::new()));
        let mut c = frames::PREFACE.to_vec();
        c.extend_from_slice(from_client);
        let (mut cr, mut cw) = client.split();
        let (mut sr, mut sw) = server.split();
        let drive = async {
            let write_c = async {
                let _ = cw.write_all(&c).await;
                let _ = cw.shutdown().await;
            };
            let write_s = async {
                let _ = sw.write_all(from_server).await;
                tokio::time::sleep(Duration::from_millis(1)).await;
                let _ = sw.shutdown().await;
            };
            let mut sink_c = Vec::new();
            let mut sink_s = Vec::new();
            // Either side may end the connection: a read error is an outcome.
            let _ = tokio::join!(
                write_c,
                write_s,
                cr.read_to_end(&mut sink_c),
                sr.read_to_end(&mut sink_s)
            );
        };
        tokio::time::timeout(Duration::from_secs(10), async {
            drive.await;
            let _ = task.await.expect("splice panicked");
        })
        .await
        .expect("splice hung");
    });
});
