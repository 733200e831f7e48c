//! Payload types of LMCache 0.5.6's MP protocol (`custom_types.py`, `ipc_wire.py`): decoders
//! that check every field, and encoders that produce exactly the maps msgspec expects. One
//! module per op family:
//! - [`key`]: [`CacheKey`] (`IPCCacheServerKey`);
//! - [`lmcache_driven`]: [`TensorMeta`], [`IpcDescriptor`], [`EngineGroupInfo`], block ids and
//!   the transfer result;
//! - [`engine_driven`]: [`EngineDrivenRegistration`], [`EngineDrivenRegistered`], [`SlotDesc`],
//!   [`PrepareStoreResponse`], [`PrepareRetrieveResponse`];
//! - [`p2p`]: what a P2P peer is asked and answers: [`WireObjectKey`], [`LayoutDesc`],
//!   [`TransferAddress`];
//! - [`blend`]: CacheBlend's match ([`blend::CbMatch`]) and unified lookup answer.

pub mod blend;
pub mod engine_driven;
pub mod key;
pub mod lmcache_driven;
pub mod p2p;

pub use engine_driven::*;
pub use key::*;
pub use lmcache_driven::*;
pub use p2p::{LayoutDesc, TransferAddress, WireObjectKey};

#[cfg(test)]
mod tests {
    use super::*;

    use crate::value::{self, map};
    use lmcache_core::{CacheSalt, Dtype, ModelName};
    use rmpv::Value;

    /// The verified example of lmcache-mp-protocol.md section 3.1, assembled piece by piece:
    /// `8a aa"model_name" a1"m" aa"world_size" 01 a9"worker_id" 00 a9"token_ids" 93 01 02 03
    /// a5"start" 00 a3"end" cd0100 aa"request_id" a5"req-1" aa"cache_salt" a0
    /// af"request_configs" c0 ae"num_kv_readers" 01`.
    fn lmcache_key_bytes() -> Vec<u8> {
        fn s(out: &mut Vec<u8>, text: &str) {
            out.push(0xa0 | text.len() as u8);
            out.extend_from_slice(text.as_bytes());
        }
        let mut b = vec![0x8a];
        s(&mut b, "model_name");
        s(&mut b, "m");
        s(&mut b, "world_size");
        b.push(0x01);
        s(&mut b, "worker_id");
        b.push(0x00);
        s(&mut b, "token_ids");
        b.extend_from_slice(&[0x93, 0x01, 0x02, 0x03]);
        s(&mut b, "start");
        b.push(0x00);
        s(&mut b, "end");
        b.extend_from_slice(&[0xcd, 0x01, 0x00]);
        s(&mut b, "request_id");
        s(&mut b, "req-1");
        s(&mut b, "cache_salt");
        b.push(0xa0);
        s(&mut b, "request_configs");
        b.push(0xc0);
        s(&mut b, "num_kv_readers");
        b.push(0x01);
        assert_eq!(b[1], 0xaa, "aa = fixstr of 10");
        b
    }

    #[test]
    fn key_decodes_lmcache_bytes_but_checks_the_range() {
        // The documented key has end=256 with 3 tokens: a client bug that LMCache raises on.
        let v = value::decode(2, &lmcache_key_bytes()).unwrap();
        let e = CacheKey::decode("key", &v).unwrap_err();
        assert!(e.to_string().contains("key.end"), "{e}");
        // The same key with a valid range.
        let mut v = v;
        if let Value::Map(m) = &mut v {
            for (k, val) in m.iter_mut() {
                if k.as_str() == Some("end") {
                    *val = Value::from(3);
                }
            }
        }
        let k = CacheKey::decode("key", &v).unwrap();
        assert_eq!(k.model_name.as_str(), "m");
        assert_eq!((k.world_size, k.worker_id), (1, Some(0)));
        assert_eq!(k.token_ids, vec![1, 2, 3]);
        assert_eq!((k.start, k.end), (0, 3));
        assert_eq!(k.request_id, "req-1");
        assert!(k.cache_salt.is_empty());
        assert_eq!(k.num_kv_readers, 1);
    }

    fn key_map(fields: Vec<(&str, Value)>) -> Value {
        let mut base = vec![
            ("model_name", Value::from("m")),
            ("world_size", Value::from(2)),
            ("worker_id", Value::Nil),
            ("token_ids", Value::Array(vec![Value::from(1); 4])),
            ("start", Value::from(0)),
            ("end", Value::from(4)),
            ("request_id", Value::from("r")),
            ("cache_salt", Value::from("")),
            ("request_configs", Value::Nil),
            ("num_kv_readers", Value::from(1)),
        ];
        for (k, v) in fields {
            base.iter_mut().find(|(n, _)| *n == k).unwrap().1 = v;
        }
        map(base)
    }

    #[test]
    fn key_fields_are_validated_by_name() {
        let cases = [
            (vec![("worker_id", Value::from(2))], "key.world_size"),
            (vec![("world_size", Value::from(0))], "key.world_size"),
            (vec![("model_name", Value::from("a@b"))], "key.model_name"),
            (vec![("cache_salt", Value::from("x/y"))], "key.cache_salt"),
            (vec![("token_ids", Value::Array(vec![Value::from(-5)]))], "key.token_ids"),
            (vec![("start", Value::from(3)), ("end", Value::from(2))], "key.end"),
            (vec![("world_size", Value::from(true))], "key.world_size"),
            (vec![("request_id", Value::Binary(b"r".to_vec()))], "key.request_id"),
        ];
        for (fields, want) in cases {
            let e = CacheKey::decode("key", &key_map(fields.clone())).unwrap_err();
            assert!(e.to_string().starts_with(want), "{fields:?}: {e}");
        }
        let ok = CacheKey::decode("key", &key_map(vec![])).unwrap();
        assert_eq!(ok.worker_id, None);
        let other = CacheKey::decode("key", &key_map(vec![("request_id", Value::from("z"))]));
        assert!(ok.same_identity(&other.unwrap()), "request_id must not affect identity");
    }

    #[test]
    fn cpu_shm_descriptor_round_trip() {
        let meta = map(vec![
            ("dtype", Value::from("float16")),
            ("shape", Value::Array(vec![Value::from(2), Value::from(8)])),
            ("stride", Value::Array(vec![Value::from(8), Value::from(1)])),
            ("storage_offset", Value::from(0)),
            ("device_uuid", Value::from("cpu")),
        ]);
        let d = map(vec![
            ("type", Value::from("cpu_shm")),
            ("shm_name", Value::from("/lmcache_kv_1_0")),
            ("nbytes", Value::from(32)),
            ("version", Value::from(1)),
            ("metadata", meta),
        ]);
        let ext = Value::Ext(1, value::encode(&d));
        let IpcDescriptor::CpuShm { shm_name, nbytes, meta } =
            IpcDescriptor::decode("kv_cache[0]", &ext).unwrap()
        else {
            panic!("not cpu_shm")
        };
        assert_eq!((shm_name.as_str(), nbytes), ("/lmcache_kv_1_0", 32));
        assert_eq!(meta.dtype, Dtype::Float16);
        let cuda = Value::Ext(1, value::encode(&map(vec![("type", Value::from("cuda"))])));
        assert_eq!(
            IpcDescriptor::decode("x", &cuda).unwrap(),
            IpcDescriptor::Device { kind: "cuda".into() }
        );
        let back = IpcDescriptor::CpuShm { shm_name, nbytes, meta };
        assert_eq!(IpcDescriptor::decode("x", &back.encode()).unwrap(), back);
        assert_eq!(ext, back.encode(), "encodes the documented map, field for field");
        let g = EngineGroupInfo {
            engine_group_id: 1,
            layer_indices: vec![0, 2],
            tokens_per_block: 16,
            sw_size_tokens: 512,
            extra_object_group_tag: 0,
            recurrent_state: true,
        };
        assert_eq!(EngineGroupInfo::decode("g", &g.encode()).unwrap(), g);
        // Fields an older client leaves out take msgspec's defaults.
        let old = map(vec![("engine_group_id", Value::from(0))]);
        assert_eq!(
            EngineGroupInfo::decode("g", &old).unwrap(),
            EngineGroupInfo::full(0, vec![], 0)
        );
        assert!(IpcDescriptor::decode("x", &Value::Ext(2, vec![])).is_err());
        assert!(IpcDescriptor::decode("x", &Value::Ext(1, vec![0xc1])).is_err());
    }

    /// Appendix A: `(b"", True)` is `92 c4 00 c3`.
    #[test]
    fn transfer_result_bytes() {
        assert_eq!(value::encode(&transfer_result(true)), vec![0x92, 0xc4, 0x00, 0xc3]);
    }

    #[test]
    fn encoders_write_lmcache_bytes_and_decoders_read_them_back() {
        // The documented key, byte for byte (end = 256 over 3 tokens is what the reference
        // example carries; encoding does not judge it, decoding does).
        let k = CacheKey {
            model_name: ModelName::new("m").unwrap(),
            world_size: 1,
            worker_id: Some(0),
            token_ids: vec![1, 2, 3],
            start: 0,
            end: 256,
            request_id: "req-1".into(),
            cache_salt: CacheSalt::EMPTY,
            num_kv_readers: 1,
        };
        assert_eq!(value::encode(&k.encode()), lmcache_key_bytes());
        let ok = CacheKey { end: 3, ..k };
        assert_eq!(CacheKey::decode("key", &ok.encode()).unwrap(), ok);
        let whole = CacheKey::whole(ModelName::new("m").unwrap(), "r", (0..40).collect(), 16);
        assert_eq!((whole.end, whole.worker_id), (32, None));
        assert_eq!(
            CacheKey::decode("key", &whole.for_worker(0).encode()).unwrap().worker_id,
            Some(0)
        );

        let reg = EngineDrivenRegistration {
            instance_id: 7,
            model_name: ModelName::new("org/model").unwrap(),
            world_size: 2,
            block_size: 16,
            num_layers: 4,
            hidden_dim_size: 1024,
            dtype: Dtype::BFloat16,
            use_mla: false,
            num_physical_slots: Some(256),
        };
        assert_eq!(EngineDrivenRegistration::decode("p", &reg.encode()).unwrap(), reg);
        let r = EngineDrivenRegistered { shm_name: "/pool".into(), pool_size: 1 << 30 };
        assert_eq!(EngineDrivenRegistered::decode("r", &r.encode()).unwrap(), r);

        let slot = |offset| SlotDesc {
            offset,
            length: 4096,
            shape: vec![2, 2, 16, 32],
            dtype: Dtype::Float16,
        };
        let store =
            PrepareStoreResponse { slots: vec![slot(0), slot(4096)], chunk_indices: vec![0, 2] };
        assert_eq!(PrepareStoreResponse::decode("r", &store.encode()).unwrap(), store);
        let empty = map(vec![("context", Value::Map(Vec::new()))]);
        assert_eq!(
            PrepareStoreResponse::decode("r", &empty).unwrap(),
            PrepareStoreResponse::default()
        );
        let retrieve = PrepareRetrieveResponse { success: true, slots: vec![slot(8192)] };
        assert_eq!(PrepareRetrieveResponse::decode("r", &retrieve.encode()).unwrap(), retrieve);
        let failed = PrepareRetrieveResponse::FAILED.encode();
        assert_eq!(
            PrepareRetrieveResponse::decode("r", &failed).unwrap(),
            PrepareRetrieveResponse::FAILED
        );
    }

    #[test]
    fn a_reply_cannot_describe_more_memory_than_its_tensor() {
        let mut big =
            SlotDesc { offset: 0, length: 4096, shape: vec![2, 2, 16, 32], dtype: Dtype::Float16 }
                .to_value();
        if let Value::Map(m) = &mut big {
            m[1].1 = Value::from(1u64 << 40);
        }
        let e = SlotDesc::decode("slots[0]", &big).unwrap_err();
        assert!(e.to_string().contains("slots[0].length"), "{e}");
        let unpaired = PrepareStoreResponse {
            slots: vec![SlotDesc { offset: 0, length: 2, shape: vec![1], dtype: Dtype::Float16 }],
            chunk_indices: vec![],
        };
        let e = PrepareStoreResponse::decode("r", &unpaired.encode()).unwrap_err();
        assert!(e.to_string().contains("chunk_indices"), "{e}");
    }
}
