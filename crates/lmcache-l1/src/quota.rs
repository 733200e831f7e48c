//! Per-tenant byte accounting and limits.
//!
//! Usage is charged when memory is reserved (staged bytes count) and credited when it is
//! freed, in physical (aligned) bytes, so the sum over tenants always equals the bytes the
//! allocator has handed out for L1 objects. A tenant without a limit is unlimited (in L1 a
//! tenant nobody configured must still be cacheable; LMCache's L2 allowlist semantics, where
//! an unknown tenant gets nothing, would make the default tenant uncacheable).

use std::collections::HashMap;

use lmcache_core::CacheSalt;

type Map<V> = HashMap<CacheSalt, V, foldhash::fast::RandomState>;

/// Limits and usage per cache_salt.
#[derive(Debug, Default)]
pub struct Quotas {
    limits: Map<u64>,
    usage: Map<u64>,
}

impl Quotas {
    /// Sets (`Some`) or removes (`None`) a tenant's limit in bytes.
    pub fn set_limit(&mut self, salt: &CacheSalt, limit: Option<u64>) {
        match limit {
            Some(l) => {
                self.limits.insert(salt.clone(), l);
            }
            None => {
                self.limits.remove(salt);
            }
        }
    }

    /// A tenant's limit, if any.
    pub fn limit(&self, salt: &CacheSalt) -> Option<u64> {
        self.limits.get(salt).copied()
    }

    /// Every configured limit.
    pub fn limits(&self) -> Vec<(CacheSalt, u64)> {
        let mut v: Vec<_> = self.limits.iter().map(|(s, &l)| (s.clone(), l)).collect();
        v.sort();
        v
    }

    /// A tenant's usage in bytes.
    pub fn usage(&self, salt: &CacheSalt) -> u64 {
        self.usage.get(salt).copied().unwrap_or(0)
    }

    /// Usage of every tenant with bytes in L1.
    pub fn usage_by_salt(&self) -> Vec<(CacheSalt, u64)> {
        let mut v: Vec<_> = self.usage.iter().map(|(s, &u)| (s.clone(), u)).collect();
        v.sort();
        v
    }

    /// Bytes the tenant may still add, `None` when unlimited.
    pub fn headroom(&self, salt: &CacheSalt) -> Option<u64> {
        self.limit(salt).map(|l| l.saturating_sub(self.usage(salt)))
    }

    /// Tenants above their limit, with the excess.
    pub fn excess(&self) -> Vec<(CacheSalt, u64)> {
        self.limits
            .iter()
            .filter_map(|(s, &l)| {
                let u = self.usage(s);
                (u > l).then(|| (s.clone(), u - l))
            })
            .collect()
    }

    pub(crate) fn charge(&mut self, salt: &CacheSalt, bytes: u64) {
        if let Some(u) = self.usage.get_mut(salt) {
            *u += bytes;
        } else {
            self.usage.insert(salt.clone(), bytes);
        }
    }

    pub(crate) fn credit(&mut self, salt: &CacheSalt, bytes: u64) {
        if let Some(u) = self.usage.get_mut(salt) {
            debug_assert!(*u >= bytes, "quota credit below zero");
            *u = u.saturating_sub(bytes);
            if *u == 0 {
                self.usage.remove(salt);
            }
        }
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn charge_credit_and_excess() {
        let mut q = Quotas::default();
        let a = CacheSalt::new("a").unwrap();
        q.charge(&a, 100);
        q.charge(&CacheSalt::EMPTY, 5);
        assert_eq!(q.headroom(&a), None);
        q.set_limit(&a, Some(60));
        assert_eq!(q.headroom(&a), Some(0));
        assert_eq!(q.excess(), vec![(a.clone(), 40)]);
        q.credit(&a, 100);
        assert_eq!(q.usage(&a), 0);
        assert!(q.usage_by_salt().iter().all(|(s, _)| s != &a), "empty bucket kept");
        q.set_limit(&a, None);
        assert!(q.limits().is_empty());
    }
}
