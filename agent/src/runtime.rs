//! Scheduling: one thread per sampler, one aggregation loop.
//!
//! Each sampler runs on its own OS thread at its own interval, so a slow NVML call in
//! one field group (PCIe throughput blocks for tens of milliseconds on real hardware)
//! never delays another. Ticks travel over a bounded channel to the aggregation loop,
//! which owns the [`Aggregator`], closes windows on time, updates the shared
//! [`AgentState`] behind `/metrics` and hands closed windows to the sinks.

use std::collections::HashSet;
use std::io::Write as _;
use std::path::PathBuf;
use std::sync::mpsc::{self, Receiver, RecvTimeoutError, SyncSender};
use std::sync::{Arc, Condvar, Mutex};
use std::thread::JoinHandle;
use std::time::{Duration, Instant};

use apron_common::{GpuWindow, ProcessRow, UnixMicros};

use crate::attribution::Attributor;
use crate::exposition::{OwnerLabels, SamplerStats, SharedState};
use crate::sampler::{FieldGroup, IssueKind, Phase, Readings, Sampler, SamplerError};
use crate::window::Aggregator;

/// A stop signal that also serves as an interruptible sleep.
#[derive(Clone, Default)]
pub struct Stop(Arc<(Mutex<bool>, Condvar)>);

impl Stop {
    pub fn stop(&self) {
        let (m, c) = &*self.0;
        *m.lock().unwrap_or_else(std::sync::PoisonError::into_inner) = true;
        c.notify_all();
    }

    pub fn is_stopped(&self) -> bool {
        *self.0.0.lock().unwrap_or_else(std::sync::PoisonError::into_inner)
    }

    /// Sleeps until `deadline`; returns true if stopped meanwhile.
    pub fn sleep_until(&self, deadline: Instant) -> bool {
        let (m, c) = &*self.0;
        let mut stopped = m.lock().unwrap_or_else(std::sync::PoisonError::into_inner);
        loop {
            if *stopped {
                return true;
            }
            let now = Instant::now();
            if now >= deadline {
                return false;
            }
            stopped = match c.wait_timeout(stopped, deadline - now) {
                Ok((g, _)) => g,
                Err(p) => p.into_inner().0,
            };
        }
    }
}

/// One sampler tick, as sent to the aggregation loop.
pub struct Tick {
    pub group: FieldGroup,
    pub readings: Readings,
    pub result: Result<(), SamplerError>,
    pub duration: Duration,
    pub at: UnixMicros,
}

/// The next tick strictly after `now` on the epoch-aligned grid of `interval`, at the
/// sampler's [`Phase`].
///
/// With an interval that divides the window, every window gets the same number of
/// readings: scheduling jitter moves a tick by milliseconds, never across a boundary.
pub fn next_tick(now: UnixMicros, interval: Duration, phase: Phase) -> UnixMicros {
    let i = i64::try_from(interval.as_micros()).unwrap_or(i64::MAX).max(1);
    let offset = match phase {
        Phase::Mid => i / 2,
        Phase::Boundary => 0,
    };
    let k = (now.0 - offset).div_euclid(i) + 1;
    UnixMicros(k * i + offset)
}

/// Runs `sampler` on its grid until stopped. A tick that overruns skips the ticks it
/// missed rather than bunching them.
pub fn spawn_sampler(
    mut sampler: Box<dyn Sampler>,
    interval: Duration,
    tx: SyncSender<Tick>,
    stop: Stop,
) -> std::io::Result<JoinHandle<()>> {
    let group = sampler.group();
    let phase = sampler.phase();
    std::thread::Builder::new().name(format!("sampler-{group}")).spawn(move || {
        loop {
            let now = UnixMicros::now();
            let due = next_tick(now, interval, phase);
            let wait = Duration::from_micros(u64::try_from(due.0 - now.0).unwrap_or(0));
            if stop.sleep_until(Instant::now() + wait) {
                return;
            }
            let at = UnixMicros::now();
            let started = Instant::now();
            let mut readings = Readings::default();
            let result = sampler.sample(at, &mut readings);
            let duration = started.elapsed();
            if tx.send(Tick { group, readings, result, duration, at }).is_err() {
                return;
            }
        }
    })
}

/// Where closed windows go besides `/metrics`.
pub trait WindowSink: Send {
    fn accept(&mut self, windows: &[GpuWindow], processes: &[ProcessRow]) -> std::io::Result<()>;
}

/// Appends every window as one JSON line (debugging and tests).
pub struct JsonLinesSink {
    out: std::io::BufWriter<std::fs::File>,
}

impl JsonLinesSink {
    pub fn create(path: &PathBuf) -> std::io::Result<Self> {
        let f = std::fs::OpenOptions::new().create(true).append(true).open(path)?;
        Ok(Self { out: std::io::BufWriter::new(f) })
    }
}

impl WindowSink for JsonLinesSink {
    fn accept(&mut self, windows: &[GpuWindow], _processes: &[ProcessRow]) -> std::io::Result<()> {
        for w in windows {
            serde_json::to_writer(&mut self.out, w)?;
            self.out.write_all(b"\n")?;
        }
        self.out.flush()
    }
}

/// The aggregation loop's inputs.
pub struct Aggregation {
    pub aggregator: Aggregator,
    pub state: SharedState,
    pub attribution: Arc<Attributor>,
    pub sinks: Vec<Box<dyn WindowSink>>,
    pub intervals: Vec<(FieldGroup, Duration)>,
}

impl Aggregation {
    /// Runs until every sampler has hung up (they do on `Stop`), then closes what is
    /// complete.
    pub fn run(mut self, rx: Receiver<Tick>) {
        {
            let mut st = self.state.lock();
            for (g, i) in &self.intervals {
                st.samplers.insert(*g, SamplerStats { interval_seconds: i.as_secs_f64(), ..Default::default() });
            }
        }
        let mut logged_failures: HashSet<(FieldGroup, &'static str, Option<usize>)> = HashSet::new();
        let mut pending_processes: Vec<ProcessRow> = Vec::new();
        loop {
            let timeout = match self.aggregator.next_close() {
                Some(t) => Duration::from_micros(u64::try_from(t.0 - UnixMicros::now().0).unwrap_or(0)),
                None => Duration::from_millis(250),
            };
            match rx.recv_timeout(timeout) {
                Ok(tick) => self.on_tick(tick, &mut logged_failures, &mut pending_processes),
                Err(RecvTimeoutError::Timeout) => {}
                Err(RecvTimeoutError::Disconnected) => {
                    // Stopping: emit what is complete; the window still running when the
                    // agent stops is partial and is not emitted.
                    let rest = self.aggregator.close_due(UnixMicros::now());
                    self.emit(&rest, &mut pending_processes);
                    return;
                }
            }
            let closed = self.aggregator.close_due(UnixMicros::now());
            if !closed.is_empty() {
                self.emit(&closed, &mut pending_processes);
            }
        }
    }

    fn on_tick(
        &mut self,
        tick: Tick,
        logged: &mut HashSet<(FieldGroup, &'static str, Option<usize>)>,
        pending_processes: &mut Vec<ProcessRow>,
    ) {
        let mut st = self.state.lock();
        let stats = st.samplers.entry(tick.group).or_default();
        stats.runs += 1;
        stats.duration_seconds_total += tick.duration.as_secs_f64();
        stats.last_duration_seconds = tick.duration.as_secs_f64();
        stats.up = tick.result.is_ok();
        if let Err(e) = &tick.result {
            stats.errors += 1;
            if logged.insert((tick.group, "", None)) {
                tracing::warn!(sampler = %tick.group, "{e}");
            }
        }
        for issue in &tick.readings.issues {
            let gpu = issue.slot.and_then(|s| st.gpus.get(s)).map(|(g, _)| g.gpu_uuid.to_string());
            let newly_unsupported = st.record_issue(tick.group, issue.what, issue.kind, issue.slot);
            match issue.kind {
                IssueKind::Unsupported if newly_unsupported => tracing::info!(
                    sampler = %tick.group,
                    call = issue.what,
                    gpu = gpu.as_deref().unwrap_or("all"),
                    "not supported here; the field stays NULL: {}",
                    issue.detail
                ),
                IssueKind::Failed if logged.insert((tick.group, issue.what, issue.slot)) => tracing::warn!(
                    sampler = %tick.group,
                    call = issue.what,
                    gpu = gpu.as_deref().unwrap_or("all"),
                    "{} (logged once; see apron_agent_sampler_errors_total)",
                    issue.detail
                ),
                _ => {}
            }
        }
        for &slot in &tick.readings.lost {
            if let Some((g, s)) = st.gpus.get_mut(slot) {
                if !s.lost {
                    tracing::error!(gpu = %g.gpu_uuid, index = g.gpu_index, "GPU is lost (fallen off the bus); other GPUs keep being served");
                }
                s.lost = true;
            }
        }
        if tick.group == FieldGroup::Processes && tick.result.is_ok() {
            st.processes = tick.readings.processes.clone();
            // The tick refreshed attribution: every GPU's holder as of now, for /metrics
            // labels and for the windows that close from now on.
            let mut owners = Vec::with_capacity(st.gpus.len());
            for (g, s) in st.gpus.iter_mut() {
                let owner = self.attribution.gpu_owner(g);
                s.owner = owner.as_ref().map_or_else(OwnerLabels::default, |o| OwnerLabels {
                    pod: o.pod.clone(),
                    namespace: o.namespace.clone(),
                    container: o.container.clone(),
                });
                owners.push(owner);
            }
            self.aggregator.set_owners(owners);
        }
        drop(st);
        if tick.group == FieldGroup::Processes {
            pending_processes.extend(tick.readings.processes.iter().cloned());
        }
        self.aggregator.add(&tick.readings, tick.at);
    }

    fn emit(&mut self, closed: &[GpuWindow], pending_processes: &mut Vec<ProcessRow>) {
        {
            let mut st = self.state.lock();
            st.apply_windows(closed);
            st.late_readings = self.aggregator.late_readings();
        }
        let processes = std::mem::take(pending_processes);
        let mut failed = 0;
        for sink in &mut self.sinks {
            if let Err(e) = sink.accept(closed, &processes) {
                failed += 1;
                tracing::warn!("window sink failed: {e}");
            }
        }
        if failed > 0 {
            self.state.lock().dropped_windows += closed.len() as u64;
        }
        for w in closed {
            tracing::trace!("{}", crate::exposition::describe(w));
        }
    }
}

/// Starts every sampler and the aggregation loop; returns their join handles.
pub fn start(
    samplers: Vec<(Box<dyn Sampler>, Duration)>,
    aggregation: Aggregation,
    stop: Stop,
) -> std::io::Result<Vec<JoinHandle<()>>> {
    let (tx, rx) = mpsc::sync_channel::<Tick>(4096);
    let mut handles = Vec::new();
    for (s, interval) in samplers {
        handles.push(spawn_sampler(s, interval, tx.clone(), stop.clone())?);
    }
    drop(tx);
    handles.push(std::thread::Builder::new().name("aggregator".into()).spawn(move || aggregation.run(rx))?);
    Ok(handles)
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn ticks_sit_mid_interval_on_the_epoch_grid() {
        let s = Duration::from_secs(1);
        assert_eq!(next_tick(UnixMicros(10_000_000), s, Phase::Mid), UnixMicros(10_500_000));
        assert_eq!(next_tick(UnixMicros(10_500_000), s, Phase::Mid), UnixMicros(11_500_000));
        assert_eq!(next_tick(UnixMicros(10_499_999), s, Phase::Mid), UnixMicros(10_500_000));
        let ms100 = Duration::from_millis(100);
        assert_eq!(next_tick(UnixMicros(10_000_001), ms100, Phase::Mid), UnixMicros(10_050_000));
        let ms250 = Duration::from_millis(250);
        assert_eq!(next_tick(UnixMicros(10_000_000), ms250, Phase::Boundary), UnixMicros(10_250_000));
        assert_eq!(next_tick(UnixMicros(10_100_000), ms250, Phase::Boundary), UnixMicros(10_250_000));
    }

    #[test]
    fn stop_interrupts_sleep() {
        let stop = Stop::default();
        let s2 = stop.clone();
        let t = std::thread::spawn(move || s2.sleep_until(Instant::now() + Duration::from_secs(60)));
        stop.stop();
        assert!(t.join().expect("joins"));
    }
}
