//! Test archive builders shared by the stage modules' unit tests.

use std::io::Write;

use super::*;

/// Test archive builder: entries written raw, so hostile names are possible.
pub(crate) struct T(tar::Builder<Vec<u8>>);

impl T {
    pub(crate) fn new() -> T {
        T(tar::Builder::new(Vec::new()))
    }
    pub(crate) fn file(mut self, name: &str, data: &[u8]) -> T {
        let mut h = tar::Header::new_old();
        h.as_old_mut().name[..name.len()].copy_from_slice(name.as_bytes());
        h.set_size(data.len() as u64);
        h.set_entry_type(tar::EntryType::Regular);
        h.set_mode(0o644);
        h.set_cksum();
        self.0.append(&h, data).unwrap();
        self
    }
    pub(crate) fn symlink(mut self, name: &str, target: &str) -> T {
        let mut h = tar::Header::new_gnu();
        h.set_entry_type(tar::EntryType::Symlink);
        h.set_size(0);
        self.0.append_link(&mut h, name, target).unwrap();
        self
    }
    pub(crate) fn done(self) -> Vec<u8> {
        self.0.into_inner().unwrap()
    }
}

pub(crate) fn layer(seed: u8) -> Vec<u8> {
    let mut b = tar::Builder::new(Vec::new());
    let data = vec![seed; 5000];
    let mut h = tar::Header::new_gnu();
    h.set_size(data.len() as u64);
    h.set_mode(0o644);
    h.set_cksum();
    b.append_data(&mut h, format!("file{seed}"), &data[..])
        .unwrap();
    b.into_inner().unwrap()
}

pub(crate) fn gz(b: &[u8]) -> Vec<u8> {
    let mut e = flate2::write::GzEncoder::new(Vec::new(), flate2::Compression::fast());
    e.write_all(b).unwrap();
    e.finish().unwrap()
}

pub(crate) fn zst(b: &[u8]) -> Vec<u8> {
    zstd::encode_all(b, 3).unwrap()
}

pub(crate) fn hex(b: &[u8]) -> String {
    sha256_hex(b).trim_start_matches("sha256:").to_string()
}

pub(crate) const CONFIG: &[u8] =
    br#"{"architecture":"amd64","os":"linux","rootfs":{"type":"layers","diff_ids":[]}}"#;

/// A skopeo-style docker-archive: layers first, v1 symlink, manifest.json last.
pub(crate) fn docker_archive(tags: &str, with_layer: bool) -> Vec<u8> {
    let l0 = layer(1);
    let l1 = gz(&layer(2));
    let mut t = T::new();
    if with_layer {
        t = t.file(&format!("{}.tar", hex(&l0)), &l0);
    }
    t = t
        .symlink("abc/layer.tar", &format!("../{}.tar", hex(&l0)))
        .file("abc/VERSION", b"1.0")
        .file("abc/json", b"{}")
        .file(&format!("{}.tar", hex(&l1)), &l1)
        .file(&format!("{}.json", hex(CONFIG)), CONFIG);
    let m = format!(
        r#"[{{"Config":"{}.json","RepoTags":{tags},"Layers":["abc/layer.tar","{}.tar"]}}]"#,
        hex(CONFIG),
        hex(&l1)
    );
    t.file("manifest.json", m.as_bytes()).done()
}

pub(crate) fn read(b: &[u8], limits: Limits) -> (Result<Plan, ArchiveError>, MemorySink) {
    let mut sink = MemorySink::default();
    let opts = ReadOptions {
        limits,
        hash_input: true,
    };
    let r = read_archive(b, &opts, &mut sink, &mut |_| {});
    (r, sink)
}

pub(crate) fn desc(mt: &str, b: &[u8], extra: &str) -> String {
    format!(
        r#"{{"mediaType":"{mt}","digest":"{}","size":{}{extra}}}"#,
        sha256_hex(b),
        b.len()
    )
}

pub(crate) fn manifest(layers: &[&[u8]]) -> Vec<u8> {
    let ls: Vec<String> = layers
        .iter()
        .map(|l| desc("application/vnd.oci.image.layer.v1.tar+gzip", l, ""))
        .collect();
    format!(
        r#"{{"schemaVersion":2,"mediaType":"{OCI_MANIFEST}","config":{},"layers":[{}]}}"#,
        desc("application/vnd.oci.image.config.v1+json", CONFIG, ""),
        ls.join(",")
    )
    .into_bytes()
}

pub(crate) fn blob(t: T, b: &[u8]) -> T {
    t.file(&format!("blobs/sha256/{}", hex(b)), b)
}

/// An OCI layout whose index lists amd64 (present) and arm64 (absent).
pub(crate) fn oci_multi(name_ann: &str) -> (Vec<u8>, Vec<u8>, Vec<u8>) {
    let l = gz(&layer(3));
    let amd = manifest(&[&l]);
    let arm = manifest(&[&gz(&layer(4))]);
    let idx = format!(
        r#"{{"schemaVersion":2,"mediaType":"{OCI_INDEX}","manifests":[{},{}]}}"#,
        desc(
            OCI_MANIFEST,
            &arm,
            r#","platform":{"os":"linux","architecture":"arm64"}"#
        ),
        desc(
            OCI_MANIFEST,
            &amd,
            r#","platform":{"os":"linux","architecture":"amd64"}"#
        ),
    )
    .into_bytes();
    let top = format!(
        r#"{{"schemaVersion":2,"manifests":[{}]}}"#,
        desc(
            OCI_INDEX,
            &idx,
            &format!(r#","annotations":{{{name_ann}}}"#)
        )
    );
    let mut t = T::new();
    t = blob(t, &l);
    t = blob(t, CONFIG);
    t = blob(t, &amd);
    t = blob(t, &idx);
    let a = t
        .file("oci-layout", br#"{"imageLayoutVersion":"1.0.0"}"#)
        .file("index.json", top.as_bytes())
        .done();
    (a, idx, amd)
}
