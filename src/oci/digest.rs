//! Content digests, as containerd accepts them.
//!
//! containerd (through `go-digest`) knows `sha256`, `sha384` and `sha512`,
//! each as lowercase hex of its own length, and refuses anything else at
//! the API, so that is the one validation every room applies: a digest
//! that passes here is one every supported containerd takes. `oci-spec`'s
//! own `Digest` also accepts unknown algorithms (and with them digests
//! containerd refuses), so it is not this type.

use std::fmt;

/// A digest containerd accepts: `<algorithm>:<lowercase hex>`.
#[derive(Clone, Debug, PartialEq, Eq, Hash, PartialOrd, Ord)]
pub struct Digest(String);

/// Why a string is not a [`Digest`].
#[derive(Clone, Debug, PartialEq, Eq, thiserror::Error)]
#[error("{0:?} is not a digest containerd accepts (sha256, sha384 or sha512, lowercase hex of its length)")]
pub struct DigestError(pub String);

/// The algorithms containerd accepts, with their hex lengths.
const ALGORITHMS: [(&str, usize); 3] = [("sha256", 64), ("sha384", 96), ("sha512", 128)];

impl Digest {
    pub fn parse(s: &str) -> Result<Digest, DigestError> {
        let ok = s.split_once(':').is_some_and(|(alg, hex)| {
            ALGORITHMS.iter().any(|(a, n)| *a == alg && hex.len() == *n)
                && hex.bytes().all(|b| matches!(b, b'0'..=b'9' | b'a'..=b'f'))
        });
        if ok {
            Ok(Digest(s.to_string()))
        } else {
            Err(DigestError(s.to_string()))
        }
    }

    /// The sha256 digest of `data` (what containerd computes by default).
    pub fn sha256(data: &[u8]) -> Digest {
        Self::of("sha256", data)
    }

    /// The digest of `data` with `algorithm` (sha256 for one this type
    /// does not know; [`Digest::parse`] never yields one).
    pub fn of(algorithm: &str, data: &[u8]) -> Digest {
        use sha2::Digest as _;
        Digest(match algorithm {
            "sha384" => format!("sha384:{}", hex::encode(sha2::Sha384::digest(data))),
            "sha512" => format!("sha512:{}", hex::encode(sha2::Sha512::digest(data))),
            _ => format!("sha256:{}", hex::encode(sha2::Sha256::digest(data))),
        })
    }

    pub fn algorithm(&self) -> &str {
        self.0.split_once(':').map_or("sha256", |(a, _)| a)
    }

    /// The hex part.
    pub fn hex(&self) -> &str {
        self.0.split_once(':').map_or("", |(_, h)| h)
    }

    pub fn as_str(&self) -> &str {
        &self.0
    }

    pub fn into_string(self) -> String {
        self.0
    }
}

impl fmt::Display for Digest {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        f.write_str(&self.0)
    }
}

/// A digest reads as the string containerd's API takes.
impl std::ops::Deref for Digest {
    type Target = str;

    fn deref(&self) -> &str {
        &self.0
    }
}

impl AsRef<str> for Digest {
    fn as_ref(&self) -> &str {
        &self.0
    }
}

impl std::str::FromStr for Digest {
    type Err = DigestError;

    fn from_str(s: &str) -> Result<Digest, DigestError> {
        Digest::parse(s)
    }
}

impl PartialEq<str> for Digest {
    fn eq(&self, other: &str) -> bool {
        self.0 == other
    }
}

impl PartialEq<&str> for Digest {
    fn eq(&self, other: &&str) -> bool {
        self.0 == *other
    }
}

impl PartialEq<String> for Digest {
    fn eq(&self, other: &String) -> bool {
        &self.0 == other
    }
}

impl From<Digest> for String {
    fn from(d: Digest) -> String {
        d.0
    }
}

impl<'de> serde::Deserialize<'de> for Digest {
    fn deserialize<D: serde::Deserializer<'de>>(d: D) -> Result<Digest, D::Error> {
        let s = String::deserialize(d)?;
        Digest::parse(&s).map_err(serde::de::Error::custom)
    }
}

impl serde::Serialize for Digest {
    fn serialize<S: serde::Serializer>(&self, s: S) -> Result<S::Ok, S::Error> {
        s.serialize_str(&self.0)
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn what_containerd_accepts() {
        for ok in [
            format!("sha256:{}", "a".repeat(64)),
            format!("sha384:{}", "0".repeat(96)),
            format!("sha512:{}", "f".repeat(128)),
        ] {
            let d = Digest::parse(&ok).unwrap();
            assert_eq!(d.as_str(), ok);
            assert_eq!(d.hex().len(), ok.len() - d.algorithm().len() - 1);
        }
        for bad in [
            "sha256:abc".to_string(),
            format!("sha256:{}", "A".repeat(64)),
            format!("sha256:{}", "g".repeat(64)),
            format!("sha384:{}", "0".repeat(64)),
            format!("md5:{}", "0".repeat(32)),
            format!("blake3:{}", "0".repeat(64)),
            "a".repeat(64),
            String::new(),
        ] {
            assert!(Digest::parse(&bad).is_err(), "{bad}");
        }
    }

    #[test]
    fn of_each_algorithm_parses_back() {
        for alg in ["sha256", "sha384", "sha512"] {
            let d = Digest::of(alg, b"x");
            assert_eq!(d.algorithm(), alg);
            assert_eq!(Digest::parse(d.as_str()), Ok(d));
        }
        assert_eq!(
            Digest::sha256(b"").as_str(),
            "sha256:e3b0c44298fc1c149afbf4c8996fb92427ae41e4649b934ca495991b7852b855"
        );
    }
}
