//! A simulated driver for the ring tests and the loom models: streams that complete their copies
//! in order, events that remember their last record, and a copy engine that, when a copy
//! completes, checks that the slot's buffer still holds what was written for that copy.
//! Everything is behind one lock, as the driver serialises its calls; a query completes at most
//! one more copy of the queried event's stream (the engine "progresses" as the host asks).
#![allow(dead_code)]

#[cfg(loom)]
use loom::sync::Mutex;
#[cfg(not(loom))]
use std::sync::Mutex;

pub struct Sim {
    inner: Mutex<Inner>,
    /// A query completes every copy issued so far on the stream (a GPU that keeps up),
    /// instead of one more.
    eager: bool,
}

struct Inner {
    /// Per stream: (slot, value the copy must read) in issue order, and how many completed.
    logs: Vec<(Vec<(usize, u64)>, usize)>,
    /// Per slot event: (stream, log length at its last record).
    events: Vec<Option<(usize, usize)>>,
    completed: usize,
}

impl Sim {
    pub fn new(streams: usize, slots: usize, eager: bool) -> Self {
        Self {
            eager,
            inner: Mutex::new(Inner {
                logs: (0..streams).map(|_| (Vec::new(), 0)).collect(),
                events: vec![None; slots],
                completed: 0,
            }),
        }
    }

    pub fn copy(&self, stream: usize, slot: usize, value: u64) {
        self.inner.lock().unwrap().logs[stream]
            .0
            .push((slot, value));
    }

    pub fn record(&self, stream: usize, slot: usize) {
        let mut g = self.inner.lock().unwrap();
        let pos = g.logs[stream].0.len();
        g.events[slot] = Some((stream, pos));
    }

    /// `read(slot)` gives the slot buffer's content as the copy engine reads it.
    pub fn query(&self, slot: usize, read: &dyn Fn(usize) -> u64) -> bool {
        let mut g = self.inner.lock().unwrap();
        let Some((stream, pos)) = g.events[slot] else {
            return true;
        };
        let g = &mut *g;
        let (log, done) = &mut g.logs[stream];
        let until = if self.eager {
            log.len()
        } else {
            log.len().min(*done + 1)
        };
        while *done < until {
            let (s, want) = log[*done];
            assert_eq!(
                read(s),
                want,
                "torn copy: slot {s} rewritten before its copy ran"
            );
            *done += 1;
            g.completed += 1;
        }
        g.logs[stream].1 >= pos
    }

    /// Completes every copy (the stager's drop); returns how many completed in all.
    pub fn drain(&self, read: &dyn Fn(usize) -> u64) -> usize {
        let mut g = self.inner.lock().unwrap();
        let g = &mut *g;
        for (log, done) in g.logs.iter_mut() {
            while *done < log.len() {
                let (s, want) = log[*done];
                assert_eq!(read(s), want, "torn copy at drop");
                *done += 1;
                g.completed += 1;
            }
        }
        g.completed
    }
}
