//! `s3`: any S3-compatible object store (AWS S3, MinIO, Ceph RGW, moto, ...), through the
//! `object_store` crate.
//!
//! Object name: `[prefix/]<wire key>`. Blobs above `multipart_threshold_bytes` are uploaded in
//! parts of `part_size_bytes`. Lookups are `HEAD`s issued concurrently; listing pages through
//! `ListObjectsV2`. Retries are bounded (`max_retries`, `retry_timeout`) so an outage turns into
//! misses quickly, and each request has a timeout.

use std::sync::Arc;
use std::time::Duration;

use async_trait::async_trait;
use bytes::Bytes;
use futures_util::StreamExt;
use futures_util::future::join_all;
use lmcache_core::ObjectKey;
use object_store::aws::{AmazonS3, AmazonS3Builder};
use object_store::path::Path;
use object_store::{
    ClientOptions, ObjectStore, ObjectStoreExt, PutPayload, RetryConfig, WriteMultipart,
};

use crate::adapter::{KeyFilter, KeyPage, L2Adapter, Stored};
use crate::blob::Blob;
use crate::error::L2Error;
use crate::wire_key;

/// Settings of the s3 adapter.
#[derive(Debug, Clone)]
pub struct S3Config {
    /// Endpoint URL (`http://127.0.0.1:9000`); `None` for AWS itself.
    pub endpoint: Option<String>,
    /// Bucket.
    pub bucket: String,
    /// Region.
    pub region: String,
    /// Access key id (else the environment's AWS credentials).
    pub access_key_id: Option<String>,
    /// Secret access key.
    pub secret_access_key: Option<String>,
    /// Address buckets as `<bucket>.<host>` rather than `<host>/<bucket>`.
    pub virtual_hosted: bool,
    /// Allow plain http endpoints.
    pub allow_http: bool,
    /// Prefix of object names.
    pub prefix: String,
    /// Blobs at least this large use multipart upload.
    pub multipart_threshold: usize,
    /// Size of each part.
    pub part_size: usize,
    /// Retries of one request.
    pub max_retries: usize,
    /// Time limit of one request.
    pub request_timeout: Duration,
    /// Time limit of connecting.
    pub connect_timeout: Duration,
}

/// The s3 adapter.
#[derive(Debug)]
pub struct S3Adapter {
    config: S3Config,
    store: Arc<AmazonS3>,
}

fn map_err(e: object_store::Error) -> L2Error {
    match e {
        object_store::Error::Generic { .. } => L2Error::unavailable(e.to_string()),
        _ => L2Error::transient(e.to_string()),
    }
}

impl S3Adapter {
    /// Builds the client and checks that the bucket answers.
    pub async fn connect(config: S3Config) -> Result<Self, L2Error> {
        let mut b = AmazonS3Builder::from_env()
            .with_bucket_name(&config.bucket)
            .with_region(&config.region)
            .with_allow_http(config.allow_http)
            .with_virtual_hosted_style_request(config.virtual_hosted)
            .with_retry(RetryConfig {
                max_retries: config.max_retries,
                retry_timeout: config.request_timeout,
                ..RetryConfig::default()
            })
            .with_client_options(
                ClientOptions::new()
                    .with_timeout(config.request_timeout)
                    .with_connect_timeout(config.connect_timeout)
                    .with_allow_http(config.allow_http),
            );
        if let Some(e) = &config.endpoint {
            b = b.with_endpoint(e);
        }
        if let Some(k) = &config.access_key_id {
            b = b.with_access_key_id(k);
        }
        if let Some(s) = &config.secret_access_key {
            b = b.with_secret_access_key(s);
        }
        let store = Arc::new(b.build().map_err(|e| L2Error::unavailable(e.to_string()))?);
        let a = Self { config, store };
        // A HEAD of a name that cannot exist: "not found" proves the bucket answers.
        match a.store.head(&a.path_str(".lmcache-rs-probe")).await {
            Ok(_) | Err(object_store::Error::NotFound { .. }) => Ok(a),
            Err(e) => Err(L2Error::unavailable(format!("bucket {}: {e}", a.config.bucket))),
        }
    }

    fn path_str(&self, name: &str) -> Path {
        if self.config.prefix.is_empty() {
            Path::from_iter([name])
        } else {
            Path::from_iter([self.config.prefix.as_str(), name])
        }
    }

    fn path(&self, key: &ObjectKey) -> Path {
        self.path_str(&wire_key::encode(key))
    }

    fn prefix_path(&self) -> Option<Path> {
        (!self.config.prefix.is_empty()).then(|| Path::from(self.config.prefix.as_str()))
    }

    /// The key of a listed object this adapter wrote: directly under its prefix (not under a
    /// deeper prefix another adapter or program uses) and named as a wire key.
    fn own_key(&self, location: &Path) -> Option<ObjectKey> {
        let depth = self.prefix_path().map_or(0, |p| p.parts().count());
        let mut parts = location.parts();
        let name = parts.nth(depth)?;
        if parts.next().is_some() {
            return None;
        }
        wire_key::decode(&wire_key::percent_decode(name.as_ref())?)
    }

    async fn put_one(&self, key: &ObjectKey, blob: Blob) -> Result<Stored, L2Error> {
        let path = self.path(key);
        let len = blob.len();
        if len < self.config.multipart_threshold {
            let payload = PutPayload::from_iter([blob.header().clone(), blob.payload]);
            self.store.put(&path, payload).await.map_err(map_err)?;
        } else {
            // The upload runs in a task of its own: if this store is cancelled (a batch that
            // timed out, a shutdown), the upload still completes, or fails and is aborted
            // (`finish` aborts on error), so no incomplete multipart upload (invisible, and
            // billed) is left in the bucket.
            let (store, part_size) = (Arc::clone(&self.store), self.config.part_size);
            let task = tokio::spawn(async move {
                let upload = store.put_multipart(&path).await?;
                let mut w = WriteMultipart::new_with_chunk_size(upload, part_size);
                w.put(blob.header().clone());
                w.put(blob.payload);
                w.finish().await
            });
            match task.await {
                Ok(Ok(_)) => {}
                Ok(Err(e)) => return Err(map_err(e)),
                Err(e) => return Err(L2Error::transient(format!("multipart upload task: {e}"))),
            }
        }
        Ok(Stored::Written(len as u64))
    }
}

#[async_trait]
impl L2Adapter for S3Adapter {
    fn kind(&self) -> &'static str {
        "s3"
    }

    async fn store(&self, items: Vec<(ObjectKey, Blob)>) -> Vec<Result<Stored, L2Error>> {
        join_all(items.into_iter().map(|(k, b)| async move { self.put_one(&k, b).await })).await
    }

    async fn lookup(&self, keys: &[ObjectKey]) -> Result<Vec<bool>, L2Error> {
        let heads = join_all(keys.iter().map(|k| async move {
            match self.store.head(&self.path(k)).await {
                Ok(m) => Ok(m.size > 0),
                Err(object_store::Error::NotFound { .. }) => Ok(false),
                Err(e) => Err(map_err(e)),
            }
        }))
        .await;
        heads.into_iter().collect()
    }

    /// `HEAD` per key, with the stored size (lets a prefetch load straight into L1 and size its
    /// time limit).
    async fn lookup_sized(&self, keys: &[ObjectKey]) -> Result<Vec<Option<u64>>, L2Error> {
        let heads = join_all(keys.iter().map(|k| async move {
            match self.store.head(&self.path(k)).await {
                Ok(m) => Ok((m.size > 0).then_some(m.size)),
                Err(object_store::Error::NotFound { .. }) => Ok(None),
                Err(e) => Err(map_err(e)),
            }
        }))
        .await;
        heads.into_iter().collect()
    }

    async fn ping(&self) -> Result<(), L2Error> {
        match self.store.head(&self.path_str(".lmcache-rs-probe")).await {
            Ok(_) | Err(object_store::Error::NotFound { .. }) => Ok(()),
            Err(e) => Err(map_err(e)),
        }
    }

    /// One listing of the prefix (every page), keeping this adapter's own keys.
    async fn scan(&self, limit: usize) -> Result<Vec<(ObjectKey, u64)>, L2Error> {
        let mut stream = self.store.list(self.prefix_path().as_ref());
        let mut out = Vec::new();
        while let Some(m) = stream.next().await {
            let m = m.map_err(map_err)?;
            if let Some(k) = self.own_key(&m.location) {
                out.push((k, m.size));
                if out.len() >= limit {
                    break;
                }
            }
        }
        Ok(out)
    }

    async fn load(&self, keys: &[ObjectKey]) -> Vec<Result<Option<Bytes>, L2Error>> {
        join_all(keys.iter().map(|k| async move {
            match self.store.get(&self.path(k)).await {
                Ok(r) => r.bytes().await.map(Some).map_err(map_err),
                Err(object_store::Error::NotFound { .. }) => Ok(None),
                Err(e) => Err(map_err(e)),
            }
        }))
        .await
    }

    async fn delete(&self, keys: &[ObjectKey]) -> Result<u64, L2Error> {
        let r = join_all(keys.iter().map(|k| async move {
            let p = self.path(k);
            match self.store.head(&p).await {
                Ok(_) => self.store.delete(&p).await.map(|()| 1u64).map_err(map_err),
                Err(object_store::Error::NotFound { .. }) => Ok(0),
                Err(e) => Err(map_err(e)),
            }
        }))
        .await;
        r.into_iter().sum()
    }

    /// Pages in the store's own order (object names, as S3 sorts them): a page lists from
    /// the cursor's object on and stops once it has `limit` keys, so no page reads the whole
    /// bucket, and the cursor (the last key's wire key) always moves forward.
    async fn list(
        &self,
        filter: &KeyFilter,
        cursor: Option<&str>,
        limit: usize,
    ) -> Result<KeyPage, L2Error> {
        let prefix = self.prefix_path();
        let mut stream = match cursor {
            Some(c) => self.store.list_with_offset(prefix.as_ref(), &self.path_str(c)),
            None => self.store.list(prefix.as_ref()),
        };
        let limit = limit.max(1);
        let mut keys = Vec::new();
        let mut more = false;
        while let Some(m) = stream.next().await {
            let m = m.map_err(map_err)?;
            let Some(k) = self.own_key(&m.location) else { continue };
            if !filter.matches(&k) {
                continue;
            }
            if keys.len() == limit {
                more = true;
                break;
            }
            keys.push((k, m.size));
        }
        let next = if more { keys.last().map(|(k, _)| wire_key::encode(k)) } else { None };
        Ok(KeyPage { keys, next })
    }

    fn describe(&self) -> serde_json::Value {
        let c = &self.config;
        serde_json::json!({
            "type": "s3",
            "endpoint": c.endpoint,
            "bucket": c.bucket,
            "region": c.region,
            "prefix": c.prefix,
            "virtual_hosted": c.virtual_hosted,
            "multipart_threshold_bytes": c.multipart_threshold,
            "part_size_bytes": c.part_size,
        })
    }
}
