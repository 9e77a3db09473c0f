//! What every connection's splice shares.

use std::sync::Arc;

use crate::proxy::intercept::Interceptor;
use crate::proxy::observe::CallObserver;

/// What every connection's splice shares.
pub struct Ctx {
    pub interceptor: Arc<dyn Interceptor>,
    pub observer: Option<Arc<dyn CallObserver>>,
    /// containerd's socket, named in errors.
    pub upstream: std::path::PathBuf,
}
