//! HPACK (RFC 7541) for the splice. Decoding mirrors each peer's dynamic
//! table so every block can be read, and hands fields to a callback as
//! slices, allocating only for the entries a block inserts. Encoding
//! ([`encode_field`]) never touches a dynamic table, so blocks the splice
//! writes itself can go out in any order.
//!
//! Written here rather than taken from a crate because h2 keeps its decoder
//! private and the published decoders rebuild their Huffman tables on every
//! string (a fifth of the proxy's CPU per call when measured). Huffman
//! strings are decoded by `httlib-huffman`'s flattened 4-bit tables.

use std::collections::VecDeque;

use bytes::{BufMut, Bytes, BytesMut};
use httlib_huffman::DecoderSpeed;

/// RFC 7541 Appendix A.
const STATIC: [(&[u8], &[u8]); 61] = [
    (b":authority", b""),
    (b":method", b"GET"),
    (b":method", b"POST"),
    (b":path", b"/"),
    (b":path", b"/index.html"),
    (b":scheme", b"http"),
    (b":scheme", b"https"),
    (b":status", b"200"),
    (b":status", b"204"),
    (b":status", b"206"),
    (b":status", b"304"),
    (b":status", b"400"),
    (b":status", b"404"),
    (b":status", b"500"),
    (b"accept-charset", b""),
    (b"accept-encoding", b"gzip, deflate"),
    (b"accept-language", b""),
    (b"accept-ranges", b""),
    (b"accept", b""),
    (b"access-control-allow-origin", b""),
    (b"age", b""),
    (b"allow", b""),
    (b"authorization", b""),
    (b"cache-control", b""),
    (b"content-disposition", b""),
    (b"content-encoding", b""),
    (b"content-language", b""),
    (b"content-length", b""),
    (b"content-location", b""),
    (b"content-range", b""),
    (b"content-type", b""),
    (b"cookie", b""),
    (b"date", b""),
    (b"etag", b""),
    (b"expect", b""),
    (b"expires", b""),
    (b"from", b""),
    (b"host", b""),
    (b"if-match", b""),
    (b"if-modified-since", b""),
    (b"if-none-match", b""),
    (b"if-range", b""),
    (b"if-unmodified-since", b""),
    (b"last-modified", b""),
    (b"link", b""),
    (b"location", b""),
    (b"max-forwards", b""),
    (b"proxy-authenticate", b""),
    (b"proxy-authorization", b""),
    (b"range", b""),
    (b"referer", b""),
    (b"refresh", b""),
    (b"retry-after", b""),
    (b"server", b""),
    (b"set-cookie", b""),
    (b"strict-transport-security", b""),
    (b"transfer-encoding", b""),
    (b"user-agent", b""),
    (b"vary", b""),
    (b"via", b""),
    (b"www-authenticate", b""),
];

/// Per-entry overhead in the table size (RFC 7541 §4.1).
const ENTRY_OVERHEAD: usize = 32;

#[derive(Debug, thiserror::Error, PartialEq, Eq)]
pub enum HpackError {
    #[error("block ends inside a field")]
    Truncated,
    #[error("integer overflows")]
    Overflow,
    #[error("index {0} is in neither table")]
    BadIndex(usize),
    #[error("invalid Huffman string")]
    Huffman,
    #[error("table size update to {0} exceeds the {1} allowed")]
    SizeUpdate(usize, usize),
    #[error("table size update after the first field")]
    LateSizeUpdate,
}

/// One direction's decoding state.
pub struct Decoder {
    /// Newest first: dynamic index 62 is `table[0]`.
    table: VecDeque<(Bytes, Bytes)>,
    size: usize,
    max: usize,
    /// Largest size a table size update may set.
    limit: usize,
    name_buf: Vec<u8>,
    value_buf: Vec<u8>,
    /// Recently decoded Huffman strings, by their encoded bytes.
    memo: Memo,
    /// Table changes (insertions, size updates) so far.
    changes: u64,
}

/// A few recent Huffman strings with their decoded form. Clients send the
/// same non-indexed literals on every call (h2 never indexes `:path`), and a
/// byte comparison is several times cheaper than decoding them again.
#[derive(Default)]
struct Memo {
    slots: [(Vec<u8>, Vec<u8>); MEMO_SLOTS],
    next: usize,
}

const MEMO_SLOTS: usize = 4;
/// Longer strings are decoded every time: they are rare and compare slowly.
const MEMO_MAX: usize = 128;

impl Memo {
    fn find(&self, raw: &[u8]) -> Option<usize> {
        (self.slots.iter()).position(|(r, d)| !d.is_empty() && r[..] == *raw)
    }

    fn decode(&mut self, raw: &[u8]) -> Result<usize, HpackError> {
        if let Some(i) = self.find(raw) {
            return Ok(i);
        }
        let i = self.next;
        self.next = (i + 1) % MEMO_SLOTS;
        let (r, d) = &mut self.slots[i];
        r.clear();
        d.clear();
        httlib_huffman::decode(raw, d, DecoderSpeed::FourBits).map_err(|_| HpackError::Huffman)?;
        if d.is_empty() {
            // An empty value cannot be told from an empty slot: no memo.
            return Ok(i);
        }
        r.extend_from_slice(raw);
        Ok(i)
    }
}

/// Where a decoded string lives until the callback has seen it.
#[derive(Clone, Copy)]
enum Src {
    Static(usize),
    Dynamic(usize),
    /// A range of the block (raw string).
    Block(usize, usize),
    /// The scratch buffer (Huffman-decoded).
    Scratch,
    /// A memo slot (Huffman-decoded).
    Memo(usize),
}

impl Decoder {
    /// A decoder with the protocol's initial 4096-byte table that accepts
    /// size updates up to `limit`.
    pub fn new(limit: usize) -> Decoder {
        Decoder {
            table: VecDeque::new(),
            size: 0,
            max: 4096,
            limit,
            name_buf: Vec::new(),
            value_buf: Vec::new(),
            memo: Memo::default(),
            changes: 0,
        }
    }

    /// Sets the largest size a table size update may set from now on: the
    /// SETTINGS_HEADER_TABLE_SIZE the receiver allowed the sender.
    pub fn set_limit(&mut self, limit: usize) {
        self.limit = limit;
    }

    /// Counts the blocks' table changes: a block that left it unchanged can
    /// be dropped, or delivered late, without the peers' tables diverging.
    pub fn changes(&self) -> u64 {
        self.changes
    }

    /// Decodes one complete header block, calling `f(name, value)` per field.
    pub fn decode(
        &mut self,
        block: &[u8],
        mut f: impl FnMut(&[u8], &[u8]),
    ) -> Result<(), HpackError> {
        let mut pos = 0;
        let mut first = true;
        while pos < block.len() {
            let b = block[pos];
            if b & 0x80 != 0 {
                let idx = int(block, &mut pos, 7)?;
                let (n, v) = self.entry(idx)?;
                f(n, v);
            } else if b & 0xe0 == 0x20 {
                if !first {
                    return Err(HpackError::LateSizeUpdate);
                }
                let max = int(block, &mut pos, 5)?;
                if max > self.limit {
                    return Err(HpackError::SizeUpdate(max, self.limit));
                }
                self.max = max;
                self.changes += 1;
                self.evict(0);
                continue; // more size updates may follow
            } else {
                let (prefix, index) = if b & 0xc0 == 0x40 {
                    (6, true)
                } else {
                    (4, false)
                };
                let idx = int(block, &mut pos, prefix)?;
                let name = match idx {
                    0 => string(block, &mut pos, &mut self.name_buf, None)?,
                    i => match i {
                        1..=61 => Src::Static(i - 1),
                        _ if i - 62 < self.table.len() => Src::Dynamic(i - 62),
                        _ => return Err(HpackError::BadIndex(i)),
                    },
                };
                let value = string(block, &mut pos, &mut self.value_buf, Some(&mut self.memo))?;
                let n = self.resolve(name, true, block);
                let v = self.resolve(value, false, block);
                f(n, v);
                if index {
                    let (n, v) = (Bytes::copy_from_slice(n), Bytes::copy_from_slice(v));
                    self.insert(n, v);
                }
            }
            first = false;
        }
        Ok(())
    }

    fn entry(&self, idx: usize) -> Result<(&[u8], &[u8]), HpackError> {
        match idx {
            1..=61 => Ok(STATIC[idx - 1]),
            _ if idx > 61 => (self.table.get(idx - 62))
                .map(|(n, v)| (&n[..], &v[..]))
                .ok_or(HpackError::BadIndex(idx)),
            _ => Err(HpackError::BadIndex(idx)),
        }
    }

    fn resolve<'a>(&'a self, s: Src, name: bool, block: &'a [u8]) -> &'a [u8] {
        match s {
            Src::Static(i) => STATIC[i].0,
            Src::Dynamic(i) => &self.table[i].0,
            Src::Block(a, b) => &block[a..b],
            Src::Scratch if name => &self.name_buf,
            Src::Scratch => &self.value_buf,
            Src::Memo(i) => &self.memo.slots[i].1,
        }
    }

    fn insert(&mut self, name: Bytes, value: Bytes) {
        self.changes += 1;
        let size = name.len() + value.len() + ENTRY_OVERHEAD;
        if size > self.max {
            // An entry larger than the table empties it (§4.4).
            self.table.clear();
            self.size = 0;
            return;
        }
        self.evict(size);
        self.size += size;
        self.table.push_front((name, value));
    }

    /// Evicts until `room` more bytes fit.
    fn evict(&mut self, room: usize) {
        while self.size + room > self.max {
            let Some((n, v)) = self.table.pop_back() else {
                break;
            };
            self.size -= n.len() + v.len() + ENTRY_OVERHEAD;
        }
    }
}

/// An integer with an `n`-bit prefix (§5.1), advancing `pos`.
fn int(block: &[u8], pos: &mut usize, n: u8) -> Result<usize, HpackError> {
    let mask = (1usize << n) - 1;
    let first = *block.get(*pos).ok_or(HpackError::Truncated)? as usize & mask;
    *pos += 1;
    if first < mask {
        return Ok(first);
    }
    let mut v = mask;
    let mut shift = 0u32;
    loop {
        let b = *block.get(*pos).ok_or(HpackError::Truncated)?;
        *pos += 1;
        if shift > 28 {
            return Err(HpackError::Overflow);
        }
        v = v
            .checked_add(((b & 0x7f) as usize) << shift)
            .ok_or(HpackError::Overflow)?;
        shift += 7;
        if b & 0x80 == 0 {
            return Ok(v);
        }
    }
}

/// A string literal (§5.2): raw strings stay in the block, Huffman strings
/// are decoded into `scratch`, or looked up in and added to `memo`.
fn string(
    block: &[u8],
    pos: &mut usize,
    scratch: &mut Vec<u8>,
    memo: Option<&mut Memo>,
) -> Result<Src, HpackError> {
    let huffman = *block.get(*pos).ok_or(HpackError::Truncated)? & 0x80 != 0;
    let len = int(block, pos, 7)?;
    let end = pos.checked_add(len).ok_or(HpackError::Overflow)?;
    let raw = block.get(*pos..end).ok_or(HpackError::Truncated)?;
    let start = *pos;
    *pos = end;
    if !huffman {
        return Ok(Src::Block(start, end));
    }
    if let Some(memo) = memo.filter(|_| raw.len() <= MEMO_MAX) {
        return Ok(Src::Memo(memo.decode(raw)?));
    }
    scratch.clear();
    httlib_huffman::decode(raw, scratch, DecoderSpeed::FourBits)
        .map_err(|_| HpackError::Huffman)?;
    Ok(Src::Scratch)
}

/// HPACK integer with an `n`-bit prefix; `first` holds the pattern bits.
fn put_int(out: &mut BytesMut, first: u8, n: u8, mut v: usize) {
    let max = (1usize << n) - 1;
    if v < max {
        out.put_u8(first | v as u8);
        return;
    }
    out.put_u8(first | max as u8);
    v -= max;
    while v >= 128 {
        out.put_u8((v % 128) as u8 | 0x80);
        v /= 128;
    }
    out.put_u8(v as u8);
}

fn put_str(out: &mut BytesMut, s: &[u8]) {
    put_int(out, 0, 7, s.len());
    out.put_slice(s);
}

/// Appends one header field to a block without using the dynamic table
/// (RFC 7541 §6.2.2, "literal without indexing"), so blocks can be written
/// in any order and the peer's decoder state never depends on imgbridge.
/// `:status: 200`, on every gRPC reply, is the static-table index 8.
pub fn encode_field(out: &mut BytesMut, name: &[u8], value: &[u8]) {
    if name == b":status" && value == b"200" {
        out.put_u8(0x88);
        return;
    }
    out.put_u8(0);
    put_str(out, name);
    put_str(out, value);
}

#[cfg(test)]
mod tests {
    use super::*;

    /// Literal without indexing, static name `idx`, Huffman value `v`.
    fn huffman_literal(idx: u8, v: &str) -> Vec<u8> {
        let mut enc = Vec::new();
        httlib_huffman::encode(v.as_bytes(), &mut enc).unwrap();
        assert!(enc.len() < 127);
        let mut out = vec![idx, 0x80 | enc.len() as u8];
        out.extend(enc);
        out
    }

    #[test]
    fn memoized_huffman_strings_decode_like_fresh_ones() {
        // More distinct strings than memo slots, in an order that both hits
        // and evicts; a decoder that never memoizes is the reference.
        let values: Vec<String> = (0..MEMO_SLOTS + 2)
            .map(|i| format!("/containerd.services.v{i}.S/Method{}", "x".repeat(i)))
            .collect();
        let mut memo = Decoder::new(4096);
        for round in 0..3 {
            for (k, v) in values.iter().enumerate().rev().skip(round) {
                let mut block = huffman_literal(4, v);
                block.extend(huffman_literal(1, &values[k % 2]));
                let got = fields(&mut memo, &block);
                assert_eq!(
                    got,
                    vec![
                        (b":path".to_vec(), v.as_bytes().to_vec()),
                        (b":authority".to_vec(), values[k % 2].as_bytes().to_vec()),
                    ]
                );
            }
        }
        // An empty Huffman string and a bad one are not remembered.
        assert_eq!(fields(&mut memo, &[0x04, 0x80])[0].1, b"");
        assert!(memo
            .decode(&[0x04, 0x84, 0xff, 0xff, 0xff, 0xff], |_, _| {})
            .is_err());
        assert_eq!(
            fields(&mut memo, &huffman_literal(4, &values[0]))[0].1,
            values[0].as_bytes()
        );
    }

    fn fields(d: &mut Decoder, block: &[u8]) -> Vec<(Vec<u8>, Vec<u8>)> {
        let mut out = Vec::new();
        d.decode(block, |n, v| out.push((n.to_vec(), v.to_vec())))
            .unwrap();
        out
    }

    #[test]
    fn rfc7541_c4_requests_with_huffman() {
        // RFC 7541 C.4.1–C.4.3: three requests sharing one table.
        let mut d = Decoder::new(4096);
        let b1 = hex::decode("828684418cf1e3c2e5f23a6ba0ab90f4ff").unwrap();
        assert_eq!(
            fields(&mut d, &b1),
            vec![
                (b":method".to_vec(), b"GET".to_vec()),
                (b":scheme".to_vec(), b"http".to_vec()),
                (b":path".to_vec(), b"/".to_vec()),
                (b":authority".to_vec(), b"www.example.com".to_vec()),
            ]
        );
        let b2 = hex::decode("828684be5886a8eb10649cbf").unwrap();
        let f2 = fields(&mut d, &b2);
        assert_eq!(f2[3], (b":authority".to_vec(), b"www.example.com".to_vec()));
        assert_eq!(f2[4], (b"cache-control".to_vec(), b"no-cache".to_vec()));
        let b3 = hex::decode("828785bf408825a849e95ba97d7f8925a849e95bb8e8b4bf").unwrap();
        let f3 = fields(&mut d, &b3);
        assert_eq!(f3[1], (b":scheme".to_vec(), b"https".to_vec()));
        assert_eq!(f3[4], (b"custom-key".to_vec(), b"custom-value".to_vec()));
        assert_eq!(d.size, 164);
    }

    #[test]
    fn eviction_follows_the_table_size() {
        // RFC 7541 C.5: responses with a 256-byte table.
        let mut d = Decoder::new(4096);
        d.max = 256;
        let r1 = hex::decode("4803333032580770726976617465611d4d6f6e2c203231204f637420323031332032303a31333a323120474d546e1768747470733a2f2f7777772e6578616d706c652e636f6d").unwrap();
        fields(&mut d, &r1);
        assert_eq!(d.size, 222);
        let r2 = hex::decode("4803333037c1c0bf").unwrap();
        let f = fields(&mut d, &r2);
        assert_eq!(f[0], (b":status".to_vec(), b"307".to_vec()));
        assert_eq!(d.size, 222);
        assert_eq!(d.table.len(), 4);
    }

    #[test]
    fn matches_another_implementation_over_many_blocks() {
        let mut enc = loona_hpack::Encoder::new();
        let mut mine = Decoder::new(4096);
        let mut theirs = loona_hpack::Decoder::new();
        for i in 0..500u32 {
            let v = format!("value-{}", i % 37);
            let path = format!(
                "/containerd.services.images.v1.Images/{}",
                ["Create", "Get", "List"][i as usize % 3]
            );
            let hs: Vec<(&[u8], &[u8])> = vec![
                (b":method", b"POST"),
                (b":path", path.as_bytes()),
                (b"containerd-namespace", b"buildkit"),
                (b"x-varying", v.as_bytes()),
            ];
            let block = enc.encode(hs.iter().copied());
            assert_eq!(
                fields(&mut mine, &block),
                theirs.decode(&block).unwrap(),
                "block {i}"
            );
        }
    }

    #[test]
    fn malformed_blocks_are_errors_not_panics() {
        let mut d = Decoder::new(4096);
        assert_eq!(d.decode(&[0xff], |_, _| {}), Err(HpackError::Truncated));
        assert_eq!(
            d.decode(&[0x80 | 70], |_, _| {}),
            Err(HpackError::BadIndex(70))
        );
        assert_eq!(d.decode(&[0x80], |_, _| {}), Err(HpackError::BadIndex(0)));
        assert_eq!(
            d.decode(&[0x40, 0x05, b'a'], |_, _| {}),
            Err(HpackError::Truncated)
        );
        assert_eq!(
            d.decode(&[0x3f, 0xe1, 0x7f], |_, _| {}),
            Err(HpackError::SizeUpdate(16384, 4096))
        );
        assert_eq!(
            d.decode(&[0x82, 0x20], |_, _| {}),
            Err(HpackError::LateSizeUpdate)
        );
        assert_eq!(
            d.decode(&[0x1f, 0xff, 0xff, 0xff, 0xff, 0xff, 0xff, 0x7f], |_, _| {}),
            Err(HpackError::Overflow)
        );
        // EOS inside a Huffman string. (Bad padding is left to the peer that
        // receives the block, which must reject it anyway.)
        assert_eq!(
            d.decode(&[0x00, 0x84, 0xff, 0xff, 0xff, 0xff, 0x80], |_, _| {}),
            Err(HpackError::Huffman)
        );
    }

    #[test]
    fn encoded_fields_decode_and_leave_the_table_empty() {
        let mut b = BytesMut::new();
        encode_field(&mut b, b":status", b"200");
        encode_field(&mut b, b"grpc-message", &[b'x'; 300]);
        encode_field(&mut b, b"content-type", b"application/grpc");
        let mut d = loona_hpack::Decoder::new();
        let got = d.decode(&b).unwrap();
        assert_eq!(got[0], (b":status".to_vec(), b"200".to_vec()));
        assert_eq!(got[1].1.len(), 300);
        assert_eq!(got[2].0, b"content-type");
        // Nothing was inserted: a block using dynamic index 62 must fail.
        assert!(d.decode(&[0x80 | 62]).is_err());
    }
}
