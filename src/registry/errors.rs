//! The distribution spec's error bodies: `{"errors":[{code,message,detail}]}`
//! with the status the spec gives each code. Every handler returns
//! [`Error`]; it becomes a response in one place ([`Error::response`]).

use bytes::Bytes;
use http::{header, HeaderValue, StatusCode};

use super::Body;
use crate::containerd;
use crate::oci::{DigestError, NameError};

/// The spec's error codes (distribution-spec v1.1, "Error Codes").
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub enum Code {
    BlobUnknown,
    BlobUploadInvalid,
    BlobUploadUnknown,
    DigestInvalid,
    ManifestBlobUnknown,
    ManifestInvalid,
    ManifestUnknown,
    NameInvalid,
    NameUnknown,
    SizeInvalid,
    Unsupported,
    Denied,
    TooManyRequests,
    /// Not the spec's: containerd failed under us.
    Unknown,
}

impl Code {
    pub fn as_str(self) -> &'static str {
        match self {
            Code::BlobUnknown => "BLOB_UNKNOWN",
            Code::BlobUploadInvalid => "BLOB_UPLOAD_INVALID",
            Code::BlobUploadUnknown => "BLOB_UPLOAD_UNKNOWN",
            Code::DigestInvalid => "DIGEST_INVALID",
            Code::ManifestBlobUnknown => "MANIFEST_BLOB_UNKNOWN",
            Code::ManifestInvalid => "MANIFEST_INVALID",
            Code::ManifestUnknown => "MANIFEST_UNKNOWN",
            Code::NameInvalid => "NAME_INVALID",
            Code::NameUnknown => "NAME_UNKNOWN",
            Code::SizeInvalid => "SIZE_INVALID",
            Code::Unsupported => "UNSUPPORTED",
            Code::Denied => "DENIED",
            Code::TooManyRequests => "TOOMANYREQUESTS",
            Code::Unknown => "UNKNOWN",
        }
    }

    /// The status the spec pairs with the code.
    fn status(self) -> StatusCode {
        match self {
            Code::BlobUnknown | Code::BlobUploadUnknown | Code::ManifestUnknown => {
                StatusCode::NOT_FOUND
            }
            Code::NameUnknown => StatusCode::NOT_FOUND,
            Code::Unsupported => StatusCode::METHOD_NOT_ALLOWED,
            Code::Denied => StatusCode::FORBIDDEN,
            Code::TooManyRequests => StatusCode::TOO_MANY_REQUESTS,
            Code::Unknown => StatusCode::INTERNAL_SERVER_ERROR,
            _ => StatusCode::BAD_REQUEST,
        }
    }
}

/// One failed request, as the client is told.
#[derive(Debug)]
pub struct Error {
    pub status: StatusCode,
    pub code: Code,
    pub message: String,
    /// Extra headers (`Range` on a 416, `Location` of a live upload).
    pub headers: Vec<(header::HeaderName, String)>,
}

pub type Result<T, E = Error> = std::result::Result<T, E>;

impl Error {
    pub fn new(code: Code, message: impl Into<String>) -> Error {
        Error {
            status: code.status(),
            code,
            message: message.into(),
            headers: Vec::new(),
        }
    }

    /// Same code, another status (413 for an oversize manifest, 416 for a
    /// chunk out of order).
    pub fn with_status(mut self, status: StatusCode) -> Error {
        self.status = status;
        self
    }

    pub fn with_header(mut self, name: header::HeaderName, value: impl Into<String>) -> Error {
        self.headers.push((name, value.into()));
        self
    }

    /// containerd failed: 500, the cause in the message (containerd not
    /// there to answer, restarting, becomes 503 so clients retry).
    pub fn containerd(e: containerd::Error) -> Error {
        let mut err = Error::new(Code::Unknown, e.to_string());
        if e.unreachable() {
            err.status = StatusCode::SERVICE_UNAVAILABLE;
        }
        err
    }

    pub fn response(self) -> http::Response<Body> {
        let body = serde_json::json!({
            "errors": [{ "code": self.code.as_str(), "message": self.message, "detail": null }]
        })
        .to_string();
        let mut r = http::Response::new(super::full(Bytes::from(body)));
        *r.status_mut() = self.status;
        let h = r.headers_mut();
        h.insert(
            header::CONTENT_TYPE,
            HeaderValue::from_static("application/json"),
        );
        for (k, v) in self.headers {
            if let Ok(v) = HeaderValue::from_str(&v) {
                h.insert(k, v);
            }
        }
        r
    }
}

impl From<containerd::Error> for Error {
    fn from(e: containerd::Error) -> Error {
        Error::containerd(e)
    }
}

impl From<DigestError> for Error {
    fn from(e: DigestError) -> Error {
        Error::new(Code::DigestInvalid, e.to_string())
    }
}

/// A bad name is `NAME_INVALID`, a bad tag `MANIFEST_INVALID` (the
/// reference of a manifest), a bad digest `DIGEST_INVALID`.
impl From<NameError> for Error {
    fn from(e: NameError) -> Error {
        let code = match &e {
            NameError::Repository(_) => Code::NameInvalid,
            NameError::Tag(_) => Code::ManifestInvalid,
            NameError::Digest(_) => Code::DigestInvalid,
        };
        Error::new(code, e.to_string())
    }
}
