//! Two-dimensional first-fit-decreasing bin packing of workloads onto GPUs.
//!
//! Each item needs compute slices (of 7) and memory slices (of 8) — its MIG profile — and
//! a GPU holds items while both sums stay within its capacity. Items are placed largest
//! first (by the larger of the two normalised sizes, then their sum, then input order, so
//! the answer is deterministic) into the first GPU with room, opening a new one when none
//! has. FFD is within 11/9·OPT + 6/9 bins in one dimension; in two it is a heuristic,
//! which is all a recommendation needs (it never claims more GPUs freed than it places).
//!
//! Real MIG placement has more rules than two sums (fixed start offsets per profile); the
//! recommendation names the profiles and the operator's MIG manager lays them out.

use serde::Serialize;

/// One workload's need, in slices.
#[derive(Clone, Copy, Debug, PartialEq, Eq, Serialize)]
pub struct Item {
    pub compute: u8,
    pub memory: u8,
}

/// A GPU's capacity in slices: 7 compute, 8 memory for every MIG-capable class.
pub const CAPACITY: Item = Item { compute: 7, memory: 8 };

/// Bins of item indices (into `items`), in the order they were opened. Items larger than
/// the capacity get a bin of their own.
pub fn first_fit_decreasing(items: &[Item], capacity: Item) -> Vec<Vec<usize>> {
    let size = |i: &Item| {
        let c = f64::from(i.compute) / f64::from(capacity.compute.max(1));
        let m = f64::from(i.memory) / f64::from(capacity.memory.max(1));
        (c.max(m), c + m)
    };
    let mut order: Vec<usize> = (0..items.len()).collect();
    order.sort_by(|&a, &b| {
        let (sa, sb) = (size(&items[a]), size(&items[b]));
        sb.0.total_cmp(&sa.0).then(sb.1.total_cmp(&sa.1)).then(a.cmp(&b))
    });
    let mut bins: Vec<(Item, Vec<usize>)> = Vec::new();
    for i in order {
        let it = items[i];
        let slot = bins.iter_mut().find(|(used, _)| {
            u16::from(used.compute) + u16::from(it.compute) <= u16::from(capacity.compute)
                && u16::from(used.memory) + u16::from(it.memory) <= u16::from(capacity.memory)
        });
        match slot {
            Some((used, members)) => {
                used.compute += it.compute;
                used.memory += it.memory;
                members.push(i);
            }
            None => bins.push((it, vec![i])),
        }
    }
    bins.into_iter().map(|(_, m)| m).collect()
}

#[cfg(test)]
mod tests {
    use super::*;

    fn it(compute: u8, memory: u8) -> Item {
        Item { compute, memory }
    }

    #[test]
    fn small_items_share_a_gpu() {
        // Two 1g.10gb workloads: one GPU.
        assert_eq!(first_fit_decreasing(&[it(1, 1), it(1, 1)], CAPACITY), vec![vec![0, 1]]);
        // Seven 1g.10gb fill one GPU exactly; the eighth opens another.
        let eight = vec![it(1, 1); 8];
        let bins = first_fit_decreasing(&eight, CAPACITY);
        assert_eq!(bins.len(), 2);
        assert_eq!(bins[0].len(), 7);
    }

    #[test]
    fn decreasing_order_and_both_dimensions() {
        // 4g.40gb (4,4), 3g.40gb (3,4), 2g.20gb (2,2), 1g.20gb (1,2): the 4g and 3g fill
        // one GPU's compute (7) and memory (8); the 2g and 1g go to a second.
        let items = [it(2, 2), it(4, 4), it(1, 2), it(3, 4)];
        assert_eq!(first_fit_decreasing(&items, CAPACITY), vec![vec![1, 3], vec![0, 2]]);
        // Memory binds: four 1g.20gb (1,2) fill 8 memory slices with 3 compute free.
        let mem = [it(1, 2); 5];
        assert_eq!(first_fit_decreasing(&mem, CAPACITY), vec![vec![0, 1, 2, 3], vec![4]]);
        assert!(first_fit_decreasing(&[], CAPACITY).is_empty());
    }
}
