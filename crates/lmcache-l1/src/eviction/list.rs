//! An intrusive doubly linked list of entry ids, stored in a dense secondary map: O(1) push,
//! remove and move-to-front without hashing. Front = most recent, back = eviction end.

use slotmap::SecondaryMap;

use crate::entry::EntryId;

#[derive(Debug, Clone, Copy)]
struct Link {
    prev: Option<EntryId>,
    next: Option<EntryId>,
}

/// A list of entry ids; each id is in the list at most once.
#[derive(Debug, Default)]
pub(crate) struct IdList {
    links: SecondaryMap<EntryId, Link>,
    front: Option<EntryId>,
    back: Option<EntryId>,
}

impl IdList {
    pub(crate) fn len(&self) -> usize {
        self.links.len()
    }

    pub(crate) fn contains(&self, id: EntryId) -> bool {
        self.links.contains_key(id)
    }

    /// Pushes `id` at the front. The caller guarantees `id` is not in the list.
    pub(crate) fn push_front(&mut self, id: EntryId) {
        debug_assert!(!self.contains(id));
        let link = Link { prev: None, next: self.front };
        if let Some(old) = self.front
            && let Some(l) = self.links.get_mut(old)
        {
            l.prev = Some(id);
        }
        self.front = Some(id);
        if self.back.is_none() {
            self.back = Some(id);
        }
        self.links.insert(id, link);
    }

    /// Removes `id`; false when it was not in the list.
    pub(crate) fn remove(&mut self, id: EntryId) -> bool {
        let Some(link) = self.links.remove(id) else {
            return false;
        };
        match link.prev {
            Some(p) => {
                if let Some(l) = self.links.get_mut(p) {
                    l.next = link.next;
                }
            }
            None => self.front = link.next,
        }
        match link.next {
            Some(n) => {
                if let Some(l) = self.links.get_mut(n) {
                    l.prev = link.prev;
                }
            }
            None => self.back = link.prev,
        }
        true
    }

    /// Moves `id` to the front; false when it was not in the list.
    pub(crate) fn move_to_front(&mut self, id: EntryId) -> bool {
        if self.front == Some(id) {
            return self.contains(id);
        }
        if !self.remove(id) {
            return false;
        }
        self.push_front(id);
        true
    }

    /// The id at the eviction end.
    pub(crate) fn back(&self) -> Option<EntryId> {
        self.back
    }

    /// The id after `id` towards the front.
    pub(crate) fn towards_front(&self, id: EntryId) -> Option<EntryId> {
        self.links.get(id).and_then(|l| l.prev)
    }

    /// Ids from the eviction end to the front.
    pub(crate) fn iter_from_back(&self) -> impl Iterator<Item = EntryId> + '_ {
        std::iter::successors(self.back, move |&id| self.towards_front(id))
    }

    pub(crate) fn clear(&mut self) {
        self.links.clear();
        self.front = None;
        self.back = None;
    }
}

/// A bounded FIFO of key hashes remembered after eviction (ARC's B1/B2, S3-FIFO's ghost).
#[derive(Debug, Default)]
pub(crate) struct GhostList {
    /// key hash → sequence number of its live queue slot.
    live: std::collections::HashMap<u64, u64, foldhash::fast::RandomState>,
    queue: std::collections::VecDeque<(u64, u64)>,
    seq: u64,
}

impl GhostList {
    pub(crate) fn len(&self) -> usize {
        self.live.len()
    }

    #[cfg(test)]
    pub(crate) fn contains(&self, hash: u64) -> bool {
        self.live.contains_key(&hash)
    }

    pub(crate) fn push(&mut self, hash: u64) {
        self.seq += 1;
        self.live.insert(hash, self.seq);
        self.queue.push_back((hash, self.seq));
    }

    pub(crate) fn remove(&mut self, hash: u64) -> bool {
        self.live.remove(&hash).is_some()
    }

    /// Drops the oldest live ghost.
    pub(crate) fn pop_oldest(&mut self) -> Option<u64> {
        while let Some((hash, seq)) = self.queue.pop_front() {
            if self.live.get(&hash) == Some(&seq) {
                self.live.remove(&hash);
                return Some(hash);
            }
        }
        None
    }

    pub(crate) fn truncate(&mut self, max: usize) {
        while self.live.len() > max {
            if self.pop_oldest().is_none() {
                break;
            }
        }
        // Keep the lazily-deleted queue from growing without bound.
        if self.queue.len() > 2 * self.live.len() + 64 {
            let live = &self.live;
            self.queue.retain(|(h, s)| live.get(h) == Some(s));
        }
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use slotmap::SlotMap;

    #[test]
    fn list_orders_and_unlinks() {
        let mut ids: SlotMap<EntryId, ()> = SlotMap::with_key();
        let [a, b, c] = [ids.insert(()), ids.insert(()), ids.insert(())];
        let mut l = IdList::default();
        l.push_front(a);
        l.push_front(b);
        l.push_front(c);
        assert_eq!(l.iter_from_back().collect::<Vec<_>>(), vec![a, b, c]);
        assert!(l.move_to_front(a));
        assert_eq!(l.iter_from_back().collect::<Vec<_>>(), vec![b, c, a]);
        assert!(l.remove(c));
        assert!(!l.remove(c));
        assert_eq!(l.iter_from_back().collect::<Vec<_>>(), vec![b, a]);
        assert!(l.remove(b) && l.remove(a));
        assert_eq!(l.back(), None);
        assert_eq!(l.len(), 0);
    }

    #[test]
    fn ghosts_forget_oldest_first() {
        let mut g = GhostList::default();
        for h in 0..10 {
            g.push(h);
        }
        assert!(g.remove(3));
        g.truncate(5);
        assert_eq!(g.len(), 5);
        assert!(!g.contains(0) && !g.contains(3) && g.contains(9));
        // Re-pushing an existing hash refreshes it.
        g.push(5);
        g.truncate(1);
        assert!(g.contains(5));
    }
}
