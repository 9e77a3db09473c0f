//! Per-key async locks: writes to one (target, name) are serialised while
//! different names proceed in parallel.

use std::collections::HashMap;
use std::sync::{Arc, Mutex, Weak};

use crate::lock::lock;
use tokio::sync::{Mutex as AsyncMutex, OwnedMutexGuard};

#[derive(Default)]
pub struct KeyedLocks {
    map: Mutex<HashMap<String, Weak<AsyncMutex<()>>>>,
}

impl KeyedLocks {
    pub async fn lock(&self, key: String) -> OwnedMutexGuard<()> {
        let m = {
            let mut map = lock(&self.map);
            if map.len() > 1024 {
                map.retain(|_, w| w.strong_count() > 0);
            }
            match map.get(&key).and_then(Weak::upgrade) {
                Some(m) => m,
                None => {
                    let m = Arc::new(AsyncMutex::new(()));
                    map.insert(key, Arc::downgrade(&m));
                    m
                }
            }
        };
        m.lock_owned().await
    }
}
