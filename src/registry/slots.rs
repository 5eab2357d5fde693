//! Copy slots shared fairly across source registries.
//!
//! A slot bounds work that talks to a source (a blob transfer, a manifest
//! read, a whole background copy). With one plain semaphore, a registry that
//! answers slowly on purpose holds every slot and starves the others. Here:
//!
//! - one key (a source registry) holds at most `per_key` of the `total`
//!   slots, so with `per_key < total` some slot is always left for the other
//!   registries, however many copies one registry has in flight;
//! - a freed slot goes to the waiting key that holds the fewest slots (first
//!   come among equals), so many slow registries together still yield each
//!   new slot to a registry that has none.
//!
//! Neither shortens a slow transfer: `copy.minTransferRate` and
//! `copy.timeout` do that, and this decides who gets the slot it frees.

use std::collections::{HashMap, VecDeque};
use std::sync::{Arc, Mutex};

use tokio::sync::oneshot;

/// Slots shared by keys, each key holding at most a cap of them.
pub struct FairSlots {
    state: Arc<Mutex<State>>,
}

struct State {
    total: usize,
    per_key: usize,
    in_use: usize,
    /// Slots held, by key; keys at zero are removed, so the map holds only
    /// keys with work in flight.
    held: HashMap<String, usize>,
    waiting: VecDeque<Waiter>,
}

struct Waiter {
    key: String,
    grant: oneshot::Sender<SlotPermit>,
}

/// A held slot; released when dropped.
pub struct SlotPermit {
    state: Arc<Mutex<State>>,
    key: String,
}

impl FairSlots {
    /// `total` slots, at most `per_key` of them for one key (both at least
    /// 1; `per_key` at most `total`).
    pub fn new(total: usize, per_key: usize) -> Self {
        let total = total.max(1);
        Self {
            state: Arc::new(Mutex::new(State {
                total,
                per_key: per_key.clamp(1, total),
                in_use: 0,
                held: HashMap::new(),
                waiting: VecDeque::new(),
            })),
        }
    }

    /// Waits for a slot for `key`. Cancel-safe: a waiter dropped before or
    /// after its grant gives the slot back.
    pub async fn acquire(&self, key: &str) -> SlotPermit {
        let (tx, rx) = oneshot::channel();
        let granted = {
            let mut state = self.state.lock().unwrap_or_else(|e| e.into_inner());
            state.waiting.push_back(Waiter {
                key: key.to_owned(),
                grant: tx,
            });
            state.dispatch(&self.state)
        };
        send(granted);
        rx.await
            .expect("a waiter is granted or dropped, never closed")
    }

    /// Slots held now by `key`.
    pub fn held(&self, key: &str) -> usize {
        let state = self.state.lock().unwrap_or_else(|e| e.into_inner());
        state.held.get(key).copied().unwrap_or(0)
    }
}

impl State {
    /// Grants free slots to waiters: each time the eligible waiter whose key
    /// holds the fewest, the earliest among equals. The grants are sent
    /// after the lock is released ([`send`]), as a refused one is dropped,
    /// which takes the lock again.
    fn dispatch(
        &mut self,
        shared: &Arc<Mutex<State>>,
    ) -> Vec<(oneshot::Sender<SlotPermit>, SlotPermit)> {
        let mut granted = Vec::new();
        // A waiter whose receiver is gone needs no slot.
        self.waiting.retain(|w| !w.grant.is_closed());
        while self.in_use < self.total {
            let pick = self
                .waiting
                .iter()
                .enumerate()
                .map(|(i, w)| (i, self.held.get(&w.key).copied().unwrap_or(0)))
                .filter(|&(_, held)| held < self.per_key)
                .min_by_key(|&(i, held)| (held, i));
            let Some((i, _)) = pick else { break };
            let w = self.waiting.remove(i).expect("index from the scan");
            *self.held.entry(w.key.clone()).or_default() += 1;
            self.in_use += 1;
            let permit = SlotPermit {
                state: shared.clone(),
                key: w.key,
            };
            granted.push((w.grant, permit));
        }
        granted
    }
}

/// Hands out grants; one whose waiter was cancelled meanwhile is dropped,
/// which releases it.
fn send(granted: Vec<(oneshot::Sender<SlotPermit>, SlotPermit)>) {
    for (tx, permit) in granted {
        drop(tx.send(permit));
    }
}

impl Drop for SlotPermit {
    fn drop(&mut self) {
        let granted = {
            let mut state = self.state.lock().unwrap_or_else(|e| e.into_inner());
            state.in_use -= 1;
            if let Some(n) = state.held.get_mut(&self.key) {
                *n -= 1;
                if *n == 0 {
                    state.held.remove(&self.key);
                }
            }
            let shared = self.state.clone();
            state.dispatch(&shared)
        };
        send(granted);
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use std::time::Duration;

    async fn granted(slots: &Arc<FairSlots>, key: &str) -> Option<SlotPermit> {
        tokio::time::timeout(Duration::from_millis(50), slots.acquire(key))
            .await
            .ok()
    }

    #[tokio::test]
    async fn one_key_never_holds_more_than_its_cap() {
        let slots = Arc::new(FairSlots::new(4, 3));
        let mut held = Vec::new();
        for _ in 0..3 {
            held.push(granted(&slots, "slow").await.expect("under the cap"));
        }
        assert!(granted(&slots, "slow").await.is_none(), "over the cap");
        assert_eq!(slots.held("slow"), 3);
        // The slot left is another registry's.
        let other = granted(&slots, "fast").await.expect("the slot left");
        assert!(granted(&slots, "fast2").await.is_none(), "all 4 in use");
        drop(other);
        assert!(granted(&slots, "fast2").await.is_some());
    }

    #[tokio::test]
    async fn a_freed_slot_goes_to_the_key_holding_fewest() {
        let slots = Arc::new(FairSlots::new(2, 2));
        let a1 = slots.acquire("a").await;
        let _a2 = slots.acquire("a").await;
        // "a" queues first, "b" after: "b" holds none, so it goes first.
        let (s1, s2) = (slots.clone(), slots.clone());
        let wait_a = tokio::spawn(async move { s1.acquire("a").await });
        tokio::time::sleep(Duration::from_millis(20)).await;
        let wait_b = tokio::spawn(async move { s2.acquire("b").await });
        tokio::time::sleep(Duration::from_millis(20)).await;
        drop(a1);
        let b = tokio::time::timeout(Duration::from_secs(1), wait_b)
            .await
            .expect("b granted")
            .unwrap();
        assert!(!wait_a.is_finished(), "a waits: it holds more");
        drop(b);
        tokio::time::timeout(Duration::from_secs(1), wait_a)
            .await
            .expect("then a")
            .unwrap();
    }

    #[tokio::test]
    async fn a_cancelled_waiter_gives_its_slot_back() {
        let slots = Arc::new(FairSlots::new(1, 1));
        let held = slots.acquire("a").await;
        assert!(granted(&slots, "b").await.is_none());
        drop(held);
        // The timed-out waiter above is gone; the slot is free.
        let again = granted(&slots, "c").await.expect("free again");
        drop(again);
        assert_eq!(slots.held("c"), 0);
    }
}
