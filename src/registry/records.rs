//! The image records of one repository: named `<host>/<repo>:<tag>` or
//! `<host>/<repo>@<digest>` and labelled with the repository, so that a
//! repository is listed by one filtered `Images.List` whatever host name
//! (`localhost:5000`, `127.0.0.1:5000`) each client used.

use crate::containerd::Image;
use crate::labels::REGISTRY_REPOSITORY;
use crate::oci::name::valid_tag;

use super::errors::Result;
use super::Registry;

/// containerd's filter for records labelled `key == value` (quoted: the
/// value holds `/`).
pub fn label_filter(key: &str, value: &str) -> String {
    format!("labels.\"{key}\"=={}", quote(value))
}

fn quote(v: &str) -> String {
    format!("\"{}\"", v.replace('\\', "\\\\").replace('"', "\\\""))
}

/// The tag of record `name` in `repo`, if it is a tag record.
pub fn tag_of<'a>(name: &'a str, repo: &str) -> Option<&'a str> {
    if name.contains('@') {
        return None;
    }
    let (left, tag) = name.rsplit_once(':')?;
    let host_end = left.len().checked_sub(repo.len() + 1)?;
    (left.ends_with(repo) && left.as_bytes()[host_end] == b'/' && valid_tag(tag)).then_some(tag)
}

impl Registry {
    /// Every record of `repo` (more filters ANDed).
    pub(super) async fn records(&self, repo: &str, also: &[String]) -> Result<Vec<Image>> {
        let mut f = label_filter(REGISTRY_REPOSITORY, repo);
        for a in also {
            f.push(',');
            f.push_str(a);
        }
        Ok(self.c.list_images(self.ns(), vec![f]).await?)
    }

    /// The record of `repo:tag`: the one named with `host` if there is one,
    /// else the one updated last (pushed under another host name).
    pub(super) async fn tag_record(
        &self,
        repo: &str,
        tag: &str,
        host: &str,
    ) -> Result<Option<Image>> {
        let exact = format!("{host}/{repo}:{tag}");
        if let Some(i) = self.c.get_image(self.ns(), &exact).await? {
            if i.labels.get(REGISTRY_REPOSITORY).map(String::as_str) == Some(repo) {
                return Ok(Some(i));
            }
        }
        let mut all: Vec<Image> = self
            .records(repo, &[])
            .await?
            .into_iter()
            .filter(|i| tag_of(&i.name, repo) == Some(tag))
            .collect();
        all.sort_by_key(|i| i.updated_at.as_ref().map(|t| (t.seconds, t.nanos)));
        Ok(all.pop())
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn tags_of_names() {
        assert_eq!(tag_of("localhost:5000/app:dev", "app"), Some("dev"));
        assert_eq!(tag_of("127.0.0.1:5000/a/b:1", "a/b"), Some("1"));
        assert_eq!(tag_of("127.0.0.1:5000/xa/b:1", "a/b"), None);
        assert_eq!(tag_of("h/app@sha256:00", "app"), None);
        assert_eq!(tag_of("localhost:5000/app", "app"), None);
    }

    #[test]
    fn filters_quote() {
        assert_eq!(label_filter("k.x", "a/b"), "labels.\"k.x\"==\"a/b\"");
    }
}
