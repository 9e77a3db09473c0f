//! Referrers (`/v2/<name>/referrers/<digest>`): the manifests of the
//! repository whose `subject` is that digest, as an OCI index, optionally
//! only those of one `artifactType`. Records carry their subject as a label
//! ([`crate::labels::REGISTRY_SUBJECT`]), so one filtered list finds them.

use std::collections::BTreeMap;

use http::{header, HeaderValue, Response, StatusCode};
use serde_json::Value;

use crate::labels::REGISTRY_SUBJECT;
use crate::oci::{Digest, Manifest, Repository};

use super::errors::Result;
use super::records::label_filter;
use super::upload::query_param;
use super::{json, Body, Registry};

const INDEX: &str = "application/vnd.oci.image.index.v1+json";

impl Registry {
    pub(super) async fn referrers(
        &self,
        name: &Repository,
        d: &Digest,
        query: Option<&str>,
    ) -> Result<Response<Body>> {
        let filter = query_param(query, "artifactType").filter(|t| !t.is_empty());
        let records = self
            .records(name, &[label_filter(REGISTRY_SUBJECT, d.as_str())])
            .await?;
        // One entry per manifest, whatever number of records name it.
        let targets: BTreeMap<String, _> = records
            .into_iter()
            .filter_map(|i| i.target)
            .map(|t| (t.digest.clone(), t))
            .collect();
        let mut manifests = Vec::new();
        for t in targets.values() {
            let Ok(body) = self
                .c
                .read_small(self.ns(), &t.digest, self.s.max_manifest as usize)
                .await
            else {
                continue; // deleted meanwhile
            };
            let Ok(doc) = Manifest::parse(&body) else {
                continue;
            };
            let artifact_type = doc.listed_artifact_type().unwrap_or("").to_string();
            if filter.as_deref().is_some_and(|f| f != artifact_type) {
                continue;
            }
            let mut desc = serde_json::json!({
                "mediaType": t.media_type,
                "digest": t.digest,
                "size": t.size,
            });
            if !artifact_type.is_empty() {
                desc["artifactType"] = Value::String(artifact_type);
            }
            if let Some(a) = &doc.annotations {
                desc["annotations"] = serde_json::json!(a);
            }
            manifests.push(desc);
        }
        let body = serde_json::json!({
            "schemaVersion": 2,
            "mediaType": INDEX,
            "manifests": manifests,
        })
        .to_string();
        let mut r = json(StatusCode::OK, body);
        r.headers_mut()
            .insert(header::CONTENT_TYPE, HeaderValue::from_static(INDEX));
        if filter.is_some() {
            r.headers_mut().insert(
                "oci-filters-applied",
                HeaderValue::from_static("artifactType"),
            );
        }
        Ok(r)
    }
}
