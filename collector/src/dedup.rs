//! Dropping retried duplicates by (agent, epoch, sequence).
//!
//! An agent numbers its batches per epoch (a new epoch at every process start) and
//! retries until acknowledged, so the same batch can arrive twice. Per (agent, epoch)
//! we keep the sequences seen as a set of disjoint inclusive ranges: in the normal
//! in-order case that is one range `[first, highest]`; a gap (a batch the agent's spool
//! dropped, or one still being retried) costs one more range.
//!
//! The state is rebuilt at start-up from the checkpoint written at each persist plus
//! the WAL records after it. Batches being appended right now are *in flight*: a
//! concurrent copy of one is told to retry rather than "duplicate", because the first
//! copy might still fail.

use std::collections::{BTreeMap, HashMap, HashSet};

use serde::{Deserialize, Serialize};

/// Beyond this many gaps in one stream, the lowest gap is given up on (treated as
/// seen) so a misbehaving agent cannot grow the state without bound.
const MAX_RANGES: usize = 4096;

/// What [`Dedup::reserve`] decided.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub enum Reservation {
    /// Not seen: the caller appends it and then calls `commit` or `release`.
    New,
    /// Already stored.
    Duplicate,
    /// Another copy is being appended at this moment.
    InFlight,
}

#[derive(Clone, Debug, Default)]
struct Stream {
    /// start → end (inclusive), disjoint and non-adjacent.
    ranges: BTreeMap<u64, u64>,
    last_seen_us: i64,
}

impl Stream {
    fn contains(&self, seq: u64) -> bool {
        self.ranges.range(..=seq).next_back().is_some_and(|(_, &end)| end >= seq)
    }

    /// Adds `seq`; false if it was present.
    fn insert(&mut self, seq: u64) -> bool {
        if self.contains(seq) {
            return false;
        }
        let before = self.ranges.range(..seq).next_back().map(|(&s, &e)| (s, e)).filter(|&(_, e)| e + 1 == seq);
        let after = seq.checked_add(1).and_then(|n| self.ranges.get(&n).map(|&e| (n, e)));
        let (start, end) = match (before, after) {
            (Some((s, _)), Some((n, e))) => {
                self.ranges.remove(&n);
                (s, e)
            }
            (Some((s, _)), None) => (s, seq),
            (None, Some((n, e))) => {
                self.ranges.remove(&n);
                (seq, e)
            }
            (None, None) => (seq, seq),
        };
        self.ranges.insert(start, end);
        if self.ranges.len() > MAX_RANGES {
            self.merge_lowest_gap();
        }
        true
    }

    fn merge_lowest_gap(&mut self) {
        let mut it = self.ranges.iter();
        let (Some((&s0, &e0)), Some((&s1, &e1))) = (it.next(), it.next()) else { return };
        tracing::warn!(
            gap_from = e0 + 1,
            gap_to = s1 - 1,
            "dedup: too many gaps in one stream; giving up on the lowest"
        );
        self.ranges.remove(&s1);
        self.ranges.insert(s0, e1.max(e0));
    }
}

/// The set of batches seen, plus those being appended now.
#[derive(Clone, Debug, Default)]
pub struct Dedup {
    /// agent → epoch → stream; nested so that lookups borrow the agent name.
    streams: HashMap<String, HashMap<String, Stream>>,
    in_flight: HashSet<(String, String, u64)>,
}

impl Dedup {
    pub fn new() -> Dedup {
        Dedup::default()
    }

    pub fn contains(&self, agent: &str, epoch: &str, sequence: u64) -> bool {
        self.stream(agent, epoch).is_some_and(|s| s.contains(sequence))
    }

    fn stream(&self, agent: &str, epoch: &str) -> Option<&Stream> {
        self.streams.get(agent)?.get(epoch)
    }

    fn stream_mut(&mut self, agent: &str, epoch: &str) -> &mut Stream {
        // One small allocation per stored batch; lookups (the hot path) borrow instead.
        self.streams.entry(agent.to_owned()).or_default().entry(epoch.to_owned()).or_default()
    }

    /// Claims a batch for appending.
    pub fn reserve(&mut self, agent: &str, epoch: &str, sequence: u64) -> Reservation {
        if self.stream(agent, epoch).is_some_and(|s| s.contains(sequence)) {
            return Reservation::Duplicate;
        }
        if !self.in_flight.insert((agent.to_owned(), epoch.to_owned(), sequence)) {
            return Reservation::InFlight;
        }
        Reservation::New
    }

    /// Gives up a reservation (the append failed; a retry is welcome).
    pub fn release(&mut self, agent: &str, epoch: &str, sequence: u64) {
        self.in_flight.remove(&(agent.to_owned(), epoch.to_owned(), sequence));
    }

    /// Records a batch as stored (after a reservation, or during replay). Returns false
    /// if it was already recorded.
    pub fn commit(&mut self, agent: &str, epoch: &str, sequence: u64, received_us: i64) -> bool {
        self.in_flight.remove(&(agent.to_owned(), epoch.to_owned(), sequence));
        let stream = self.stream_mut(agent, epoch);
        stream.last_seen_us = stream.last_seen_us.max(received_us);
        stream.insert(sequence)
    }

    /// Forgets streams not seen since `cutoff_us` (old agent epochs); returns how many.
    pub fn prune(&mut self, cutoff_us: i64) -> usize {
        let before = self.streams();
        for epochs in self.streams.values_mut() {
            epochs.retain(|_, s| s.last_seen_us >= cutoff_us);
        }
        self.streams.retain(|_, epochs| !epochs.is_empty());
        before - self.streams()
    }

    /// The number of (agent, epoch) streams tracked.
    pub fn streams(&self) -> usize {
        self.streams.values().map(HashMap::len).sum()
    }

    /// The stored state, without in-flight reservations, for the checkpoint.
    pub fn to_state(&self) -> DedupState {
        let mut streams: Vec<StreamState> = self
            .streams
            .iter()
            .flat_map(|(agent, epochs)| {
                epochs.iter().map(move |(epoch, s)| StreamState {
                    agent: agent.clone(),
                    epoch: epoch.clone(),
                    last_seen_us: s.last_seen_us,
                    ranges: s.ranges.iter().map(|(&a, &b)| [a, b]).collect(),
                })
            })
            .collect();
        streams.sort_by(|a, b| (&a.agent, &a.epoch).cmp(&(&b.agent, &b.epoch)));
        DedupState { streams }
    }

    pub fn from_state(state: DedupState) -> Dedup {
        let mut d = Dedup::new();
        for s in state.streams {
            let stream = d.stream_mut(&s.agent, &s.epoch);
            stream.last_seen_us = s.last_seen_us;
            for [a, b] in s.ranges {
                // Re-inserting range by range keeps the invariants even for a hand-edited file.
                if a <= b && !stream.contains(a) && !stream.contains(b) {
                    stream.ranges.insert(a, b);
                }
            }
        }
        d
    }
}

/// The serialised dedup state (part of the checkpoint file).
#[derive(Clone, Debug, Default, PartialEq, Eq, Serialize, Deserialize)]
#[serde(deny_unknown_fields)]
pub struct DedupState {
    pub streams: Vec<StreamState>,
}

#[derive(Clone, Debug, PartialEq, Eq, Serialize, Deserialize)]
#[serde(deny_unknown_fields)]
pub struct StreamState {
    pub agent: String,
    pub epoch: String,
    pub last_seen_us: i64,
    /// Inclusive `[start, end]` ranges of sequences seen.
    pub ranges: Vec<[u64; 2]>,
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn in_order_sequences_stay_one_range() {
        let mut d = Dedup::new();
        for seq in 1..=1000 {
            assert_eq!(d.reserve("a", "7", seq), Reservation::New);
            assert!(d.commit("a", "7", seq, 10));
        }
        let state = d.to_state();
        assert_eq!(state.streams.len(), 1);
        assert_eq!(state.streams[0].ranges, vec![[1, 1000]]);
        assert_eq!(d.reserve("a", "7", 500), Reservation::Duplicate);
        assert_eq!(d.reserve("a", "8", 500), Reservation::New, "another epoch is another stream");
        assert_eq!(d.reserve("b", "7", 500), Reservation::New, "another agent is another stream");
    }

    #[test]
    fn gaps_and_out_of_order_merge() {
        let mut d = Dedup::new();
        for seq in [5, 1, 3, 2, 9, 4] {
            assert!(d.commit("a", "1", seq, 0));
        }
        assert!(!d.commit("a", "1", 3, 0), "second commit of the same batch");
        assert_eq!(d.to_state().streams[0].ranges, vec![[1, 5], [9, 9]]);
        assert!(d.contains("a", "1", 9));
        assert!(!d.contains("a", "1", 6));
        assert!(d.commit("a", "1", 6, 0) && d.commit("a", "1", 8, 0) && d.commit("a", "1", 7, 0));
        assert_eq!(d.to_state().streams[0].ranges, vec![[1, 9]]);
        assert!(d.commit("a", "1", u64::MAX, 0), "no overflow at the top");
        assert!(d.contains("a", "1", u64::MAX));
    }

    #[test]
    fn in_flight_copies_are_told_to_retry() {
        let mut d = Dedup::new();
        assert_eq!(d.reserve("a", "1", 1), Reservation::New);
        assert_eq!(d.reserve("a", "1", 1), Reservation::InFlight);
        d.release("a", "1", 1);
        assert_eq!(d.reserve("a", "1", 1), Reservation::New, "a failed append can be retried");
        d.commit("a", "1", 1, 0);
        assert_eq!(d.reserve("a", "1", 1), Reservation::Duplicate);
    }

    #[test]
    fn state_round_trips_and_prunes() {
        let mut d = Dedup::new();
        d.commit("old", "1", 1, 100);
        d.commit("new", "2", 1, 5_000);
        d.commit("new", "2", 3, 5_000);
        let state = d.to_state();
        let json = serde_json::to_string(&state).expect("json");
        let back = Dedup::from_state(serde_json::from_str(&json).expect("parse"));
        assert_eq!(back.to_state(), state);
        let mut back = back;
        assert_eq!(back.prune(1_000), 1);
        assert!(!back.contains("old", "1", 1));
        assert!(back.contains("new", "2", 3));
    }

    #[test]
    fn gap_count_is_bounded() {
        let mut d = Dedup::new();
        for i in 0..(MAX_RANGES as u64 + 10) {
            d.commit("a", "1", i * 2, 0);
        }
        assert!(d.to_state().streams[0].ranges.len() <= MAX_RANGES);
    }
}
