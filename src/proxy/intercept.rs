//! The interception point: how policy code (replication) hooks selected unary
//! calls without knowing anything about HTTP/2.
//!
//! The transport asks [`Interceptor::select`] once per call. `None` means pure
//! passthrough (streamed, never buffered). `Some(hook)` means the call is
//! unary and is held: the request message goes to [`Hook::before`], is
//! forwarded unchanged, and on upstream OK the response message goes to
//! [`Hook::after`] before the original reply bytes are relayed.
//!
//! Streaming calls are never buffered, but the transport can watch one
//! ([`Interceptor::watch`]): it shows the policy the head of each request
//! message and, when asked, holds the replies that follow until the
//! policy's future ends ([`StreamWatch`]).

use std::future::Future;
use std::marker::PhantomData;
use std::pin::Pin;
use std::sync::Arc;

use bytes::Bytes;

/// What policy code may know about a call.
#[derive(Clone, Debug, Default)]
pub struct CallInfo {
    /// Full gRPC method path, e.g. `/containerd.services.images.v1.Images/Create`.
    pub method: Arc<str>,
    /// First `containerd-namespace` value, as containerd itself reads it.
    pub namespace: Option<Arc<str>>,
}

/// Future returned by hooks; an `Err` becomes the caller's gRPC status.
pub type HookFuture<'a> = Pin<Box<dyn Future<Output = Result<(), tonic::Status>> + Send + 'a>>;

/// Decides which calls to hold.
pub trait Interceptor: Send + Sync + 'static {
    /// Called for every call; must be cheap because it sits on the data path.
    fn select(&self, call: &CallInfo) -> Option<Box<dyn Hook>>;

    /// Called for every call [`Interceptor::select`] passed on; as cheap.
    fn watch(&self, _call: &CallInfo) -> Option<Box<dyn StreamWatch>> {
        None
    }
}

/// Future that ends when held replies may go on. A watch never fails the
/// call: the client sees containerd's answer, only later.
pub type WatchFuture = Pin<Box<dyn Future<Output = ()> + Send + 'static>>;

/// How many bytes of each request message a [`StreamWatch`] is shown: the
/// fields policy reads come before any payload (protobuf encodes fields in
/// number order, and every payload field of the watched calls is numbered
/// after them).
pub const WATCH_HEAD: usize = 1024;

/// A streaming call watched message by message, never buffered.
///
/// Only for calls that answer each request message with exactly one reply
/// message, in order (`Content.Write`): the transport finds a message's
/// reply by counting, however many messages the client sends before it
/// reads one.
pub trait StreamWatch: Send {
    /// The first [`WATCH_HEAD`] bytes (or all, if shorter) of one
    /// uncompressed request message. `true` holds this message's reply:
    /// the call's frames wait from its first byte, and the whole reply
    /// message goes to [`StreamWatch::reply`].
    fn request(&mut self, head: &[u8]) -> bool;

    /// The reply to a message [`StreamWatch::request`] wanted. The call's
    /// frames (this message and any after it) wait until the future ends;
    /// `None` releases them at once.
    fn reply(&mut self, message: Bytes) -> Option<WatchFuture>;

    /// The call ended with `grpc_status` (`None`: no status). A future
    /// holds the end (and anything still held) until it ends.
    fn end(&mut self, grpc_status: Option<i32>) -> Option<WatchFuture>;
}

/// Work attached to one held call.
pub trait Hook: Send {
    /// Whether [`Hook::before`] does anything. Only then is the request held
    /// back from containerd until it has run.
    fn wants_before(&self) -> bool {
        false
    }

    /// Runs on the request message before it is forwarded; an error answers
    /// the caller without contacting containerd.
    fn before<'a>(&'a mut self, _request: &'a Bytes) -> HookFuture<'a> {
        Box::pin(async { Ok(()) })
    }

    /// Runs after containerd answered OK, before the reply is relayed; an
    /// error replaces the reply (containerd's change is not rolled back).
    fn after(self: Box<Self>, request: Bytes, response: Bytes) -> HookFuture<'static>;

    /// The client reset the call after its whole request had gone to
    /// containerd, which may carry it out anyway: work to run detached
    /// (it answers no one), with the request message.
    fn abandoned(self: Box<Self>, _request: Bytes) -> Option<WatchFuture> {
        None
    }
}

/// Passthrough only: the proxy without policy.
pub struct NoIntercept;

impl Interceptor for NoIntercept {
    fn select(&self, _call: &CallInfo) -> Option<Box<dyn Hook>> {
        None
    }
}

/// Adapts a closure over decoded prost messages into a [`Hook`].
///
/// A reply that does not decode is reported as `Internal`: the upstream call
/// succeeded, but imgbridge cannot act on something it cannot read.
pub fn typed<Req, Resp, F, Fut>(f: F) -> Box<dyn Hook>
where
    Req: prost::Message + Default + 'static,
    Resp: prost::Message + Default + 'static,
    F: FnOnce(Req, Resp) -> Fut + Send + 'static,
    Fut: Future<Output = Result<(), tonic::Status>> + Send + 'static,
{
    Box::new(Typed {
        f,
        _m: PhantomData::<fn(Req, Resp)>,
    })
}

struct Typed<F, Req, Resp> {
    f: F,
    _m: PhantomData<fn(Req, Resp)>,
}

impl<Req, Resp, F, Fut> Hook for Typed<F, Req, Resp>
where
    Req: prost::Message + Default + 'static,
    Resp: prost::Message + Default + 'static,
    F: FnOnce(Req, Resp) -> Fut + Send + 'static,
    Fut: Future<Output = Result<(), tonic::Status>> + Send + 'static,
{
    fn after(self: Box<Self>, request: Bytes, response: Bytes) -> HookFuture<'static> {
        let decoded = Req::decode(request).and_then(|req| Ok((req, Resp::decode(response)?)));
        match decoded {
            Ok((req, resp)) => Box::pin((self.f)(req, resp)),
            Err(e) => Box::pin(async move {
                Err(tonic::Status::internal(format!(
                    "imgbridge could not decode the call to act on it (the upstream call succeeded): {e}"
                )))
            }),
        }
    }
}
