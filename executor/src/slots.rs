//! A rank's live buffers by name ([`BufferMap`]): the names every step looks up once per
//! parameter (its values, its optimizer state, its reduced gradient) live in vectors
//! indexed by parameter, the global norm (which every guarded optimizer reads) in a slot
//! of its own, the rest in a hash map.
//!
//! Why: the step's tail binds three or four of these per parameter (the global norm
//! reads every reduced gradient, each optimizer its parameter, state and gradient), by
//! when the backward has gone through the host's caches: an index into a vector whose
//! handles sit side by side touches fewer cache lines than a hash lookup. Its share of
//! the tail's host time was not measured on its own (docs/performance.md, "Through the
//! executor", measured it together with the rows).

use std::ops::Index;

use overlap_graph::{Buffer, ParamId};
use rustc_hash::FxHashMap as HashMap;

/// The dense kinds, at the index [`dense`] gives.
const DENSE: usize = 4;

/// Where a name lives in the dense vectors: (kind, parameter).
fn dense(b: &Buffer) -> Option<(usize, usize)> {
    let (kind, param): (usize, ParamId) = match *b {
        Buffer::Param { param } => (0, param),
        Buffer::OptState { param } => (1, param),
        Buffer::Reduced { param } => (2, param),
        Buffer::Norm => (3, 0),
        _ => return None,
    };
    Some((kind, param as usize))
}

/// The name of dense slot `(kind, param)`.
fn name(kind: usize, param: usize) -> Buffer {
    let param = param as ParamId;
    match kind {
        0 => Buffer::Param { param },
        1 => Buffer::OptState { param },
        2 => Buffer::Reduced { param },
        _ => Buffer::Norm,
    }
}

/// Live buffers by name, as a map.
pub(crate) struct BufferMap<T> {
    dense: [Vec<Option<T>>; DENSE],
    other: HashMap<Buffer, T>,
}

impl<T> Default for BufferMap<T> {
    fn default() -> Self {
        BufferMap {
            dense: Default::default(),
            other: HashMap::default(),
        }
    }
}

impl<T> BufferMap<T> {
    /// The buffer of `name`, if live.
    pub(crate) fn get(&self, name: &Buffer) -> Option<&T> {
        match dense(name) {
            Some((k, p)) => self.dense[k].get(p).and_then(Option::as_ref),
            None => self.other.get(name),
        }
    }

    /// Whether `name` is live.
    pub(crate) fn contains_key(&self, name: &Buffer) -> bool {
        self.get(name).is_some()
    }

    /// Makes `buf` the memory of `name`; returns what it replaces.
    pub(crate) fn insert(&mut self, name: Buffer, buf: T) -> Option<T> {
        match dense(&name) {
            Some((k, p)) => {
                let v = &mut self.dense[k];
                if v.len() <= p {
                    v.resize_with(p + 1, || None);
                }
                v[p].replace(buf)
            }
            None => self.other.insert(name, buf),
        }
    }

    /// Forgets `name`; returns its buffer.
    pub(crate) fn remove(&mut self, name: &Buffer) -> Option<T> {
        match dense(name) {
            Some((k, p)) => self.dense[k].get_mut(p).and_then(Option::take),
            None => self.other.remove(name),
        }
    }

    /// Keeps only the names `keep` says yes to.
    pub(crate) fn retain(&mut self, mut keep: impl FnMut(&Buffer, &mut T) -> bool) {
        for (k, v) in self.dense.iter_mut().enumerate() {
            for (p, slot) in v.iter_mut().enumerate() {
                if slot.as_mut().is_some_and(|b| !keep(&name(k, p), b)) {
                    *slot = None;
                }
            }
        }
        self.other.retain(|b, t| keep(b, t));
    }
}

impl<T> Index<&Buffer> for BufferMap<T> {
    type Output = T;

    /// The buffer of a live name; panics when it is not (as a map's index does).
    fn index(&self, name: &Buffer) -> &T {
        match self.get(name) {
            Some(b) => b,
            None => panic!("buffer {name} is not live"),
        }
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn dense_and_hashed_names_behave_as_one_map() {
        let mut m = BufferMap::default();
        let names = [
            Buffer::Param { param: 7 },
            Buffer::OptState { param: 0 },
            Buffer::Reduced { param: 3 },
            Buffer::Accum { param: 3 },
            Buffer::Norm,
        ];
        for (i, b) in names.iter().enumerate() {
            assert_eq!(m.insert(*b, i), None);
        }
        assert_eq!(m.insert(Buffer::Reduced { param: 3 }, 9), Some(2));
        assert_eq!(m.get(&Buffer::Reduced { param: 3 }), Some(&9));
        assert_eq!(m.get(&Buffer::Reduced { param: 2 }), None);
        assert_eq!(m.get(&Buffer::Reduced { param: 100 }), None);
        assert_eq!(m[&Buffer::Norm], 4);
        m.retain(|b, _| b.is_persistent());
        assert!(m.contains_key(&Buffer::Param { param: 7 }));
        assert!(m.contains_key(&Buffer::OptState { param: 0 }));
        assert!(!m.contains_key(&Buffer::Reduced { param: 3 }));
        assert!(!m.contains_key(&Buffer::Norm));
        assert_eq!(m.remove(&Buffer::Param { param: 7 }), Some(0));
        assert_eq!(m.remove(&Buffer::Param { param: 7 }), None);
        assert_eq!(m.remove(&Buffer::Accum { param: 3 }), None);
    }
}
