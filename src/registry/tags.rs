//! Tag list (`/v2/<name>/tags/list`), sorted, paginated with `n` and
//! `last`, and a `Link` header to the next page as the spec describes.

use std::collections::BTreeSet;

use http::{Response, StatusCode};

use crate::oci::Repository;

use super::errors::{Code, Error, Result};
use super::records::tag_of;
use super::upload::query_param;
use super::{json, Body, Registry};

impl Registry {
    pub(super) async fn list_tags(
        &self,
        name: &Repository,
        query: Option<&str>,
    ) -> Result<Response<Body>> {
        let records = self.records(name, &[]).await?;
        if records.is_empty() {
            return Err(Error::new(
                Code::NameUnknown,
                format!("no repository {name}"),
            ));
        }
        let all: BTreeSet<&str> = records
            .iter()
            .filter_map(|i| tag_of(&i.name, name))
            .collect();
        let last = query_param(query, "last");
        let n = match query_param(query, "n") {
            Some(n) => Some(n.parse::<usize>().map_err(|_| {
                Error::new(Code::Unsupported, format!("n={n:?} is not a number"))
                    .with_status(StatusCode::BAD_REQUEST)
            })?),
            None => None,
        };
        let after: Vec<&str> = all
            .iter()
            .copied()
            .filter(|t| last.as_deref().is_none_or(|l| *t > l))
            .collect();
        let page: Vec<&str> = after
            .iter()
            .copied()
            .take(n.unwrap_or(usize::MAX))
            .collect();
        let body = serde_json::json!({ "name": name.as_str(), "tags": page }).to_string();
        let mut r = json(StatusCode::OK, body);
        if let (Some(n), Some(l)) = (n, page.last()) {
            if after.len() > page.len() {
                let link = format!("</v2/{name}/tags/list?n={n}&last={l}>; rel=\"next\"");
                if let Ok(v) = http::HeaderValue::from_str(&link) {
                    r.headers_mut().insert(http::header::LINK, v);
                }
            }
        }
        Ok(r)
    }
}
