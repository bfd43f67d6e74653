//! `seqpipe gpu link`: the NCCL link between two GPUs, checked on real hardware. This process is
//! rank 0; it starts a copy of itself as rank 1 (on the second GPU, or on the same one where NCCL
//! allows two ranks per GPU), then
//! 1. bounces a stage-boundary-sized buffer back and forth: every round's bytes must come back
//!    bit-identical, and the median round trip gives the link's bandwidth, next to the two host
//!    copies (device→host→device) one hop of the host-staged link costs before any TCP;
//! 2. SIGKILLs rank 1 and posts a receive from it: the link's watchdog (an abort tripped from
//!    another thread, as the runtime does when a peer's TCP link dies) must end the wait with an
//!    error instead of hanging, and the GPU must still work afterwards.
//!
//! Prints one JSON line (or the reason it cannot run on this machine, with `"skipped"`).

use clap::Args;

/// Flags of `seqpipe gpu link`.
#[derive(Args, Debug)]
pub struct LinkArgs {
    /// CUDA device of rank 0.
    #[arg(long, default_value_t = 0)]
    device: usize,
    /// MiB per transfer (default: one (4, 1024, 768) f32 activation, GPT-2 124M's stage boundary).
    #[arg(long, default_value_t = 12.0)]
    mib: f64,
    /// Timed round trips (after one untimed).
    #[arg(long, default_value_t = 20)]
    rounds: usize,
    /// Seconds rank 0 waits for its peer at any point before giving up.
    #[arg(long, default_value_t = 60)]
    timeout_s: u64,
    /// Internal: run as rank 1 of the link with this id (hex).
    #[arg(long, hide = true)]
    serve: Option<String>,
}

#[cfg(all(feature = "cuda", not(feature = "emulate-gpu")))]
impl LinkArgs {
    fn elements(&self) -> usize {
        ((self.mib * 1024.0 * 1024.0) / 4.0).max(1.0) as usize
    }

    fn timeout(&self) -> std::time::Duration {
        std::time::Duration::from_secs(self.timeout_s.max(1))
    }
}

// Without the `cuda` feature `seqpipe gpu` refuses every command before it gets here; an
// emulated GPU (`emulate-gpu`) has no NCCL.
#[cfg(all(feature = "cuda", not(feature = "emulate-gpu")))]
pub use enabled::run;

#[cfg(all(feature = "cuda", not(feature = "emulate-gpu")))]
mod enabled {
    use std::process::{Child, Command, Stdio};
    use std::time::Instant;

    use anyhow::{Context, Result, bail};
    use gpu::nccl::{Abort, LinkId, NcclLink, nccl_version, shares_one_gpu};
    use gpu::{Buf, Gpu, Precision, device_count};
    use serde_json::json;

    use super::LinkArgs;
    use crate::bench::step::median;

    /// The value of element `i` in round `round`: distinct per round, exact in f32.
    fn pattern(round: usize, i: usize) -> f32 {
        ((i * 7 + round * 13) % 65_521) as f32 - 32_760.5
    }

    pub fn run(args: &LinkArgs) -> Result<()> {
        match &args.serve {
            Some(hex) => serve(args, LinkId::from_hex(hex)?),
            None => check(args),
        }
    }

    /// Rank 1: echo every buffer back until the link dies (or the process is killed).
    fn serve(args: &LinkArgs, id: LinkId) -> Result<()> {
        let gpu = Gpu::open(args.device, Precision::Fp32)?;
        let n = args.elements();
        let mut link = NcclLink::connect(&gpu, id, 1, args.timeout(), Abort::default())?;
        let mut buf: Buf<f32> = gpu.zeros(n)?;
        loop {
            let deadline = Instant::now() + args.timeout();
            link.recv(&mut buf, n, deadline)?;
            link.send(&buf, n, deadline)?;
            link.wait(deadline)?;
        }
    }

    fn spawn_peer(args: &LinkArgs, device: usize, id: LinkId) -> Result<Child> {
        let exe = std::env::current_exe().context("finding this executable")?;
        Command::new(exe)
            .args(["gpu", "link", "--device", &device.to_string()])
            .args(["--mib", &args.mib.to_string()])
            .args(["--timeout-s", &args.timeout_s.to_string()])
            .args(["--serve", &id.to_hex()])
            .stdin(Stdio::null())
            .spawn()
            .context("starting rank 1 of the link")
    }

    fn skipped(why: String) -> Result<()> {
        println!("{}", json!({ "skipped": why }));
        Ok(())
    }

    fn check(args: &LinkArgs) -> Result<()> {
        let version = nccl_version()?;
        let devices = device_count()?;
        let peer_device = if devices >= 2 {
            (args.device + 1) % devices
        } else if shares_one_gpu(version) {
            args.device
        } else {
            return skipped(format!(
                "{devices} GPU and NCCL {}.{}.{}: two ranks on one GPU need NCCL >= 2.30 with NCCL_MULTI_RANK_GPU_ENABLE=1",
                version.0, version.1, version.2
            ));
        };
        let gpu = Gpu::open(args.device, Precision::Fp32)?;
        let n = args.elements();
        let id = LinkId::new()?;
        let mut peer = spawn_peer(args, peer_device, id)?;
        let result = exercise(args, &gpu, id, n, &mut peer);
        let _ = peer.kill();
        let _ = peer.wait();
        let mut report = result?;
        report["nccl"] = json!(format!("{}.{}.{}", version.0, version.1, version.2));
        report["gpu"] = json!(gpu.name());
        report["devices"] = json!([args.device, peer_device]);
        println!("{report}");
        if report["bit_exact"] != json!(true) || report["usable_after_abort"] != json!(true) {
            bail!("the NCCL link check failed: {report}");
        }
        Ok(())
    }

    fn exercise(
        args: &LinkArgs,
        gpu: &Gpu,
        id: LinkId,
        n: usize,
        peer: &mut Child,
    ) -> Result<serde_json::Value> {
        let abort = Abort::default();
        let mut link = NcclLink::connect(gpu, id, 0, args.timeout(), abort.clone())?;
        let mut sent: Buf<f32> = gpu.zeros(n)?;
        let mut back: Buf<f32> = gpu.zeros(n)?;
        let mut round_ms = Vec::new();
        let mut bit_exact = true;
        for round in 0..=args.rounds {
            let host: Vec<f32> = (0..n).map(|i| pattern(round, i)).collect();
            gpu.write(&mut sent, &host)?;
            gpu.sync()?;
            let started = Instant::now();
            let deadline = started + args.timeout();
            link.send(&sent, n, deadline)?;
            link.recv(&mut back, n, deadline)?;
            link.wait(deadline)?;
            if round > 0 {
                round_ms.push(started.elapsed().as_secs_f64() * 1e3);
            }
            let got = gpu.download(&back)?;
            bit_exact &= got
                .iter()
                .zip(&host)
                .all(|(a, b)| a.to_bits() == b.to_bits());
        }
        // One hop of the host-staged link before TCP: device -> host, host -> device.
        let mut staged_ms = Vec::new();
        for _ in 0..args.rounds.max(1) {
            let started = Instant::now();
            let host = gpu.download(&sent)?;
            gpu.write(&mut back, &host)?;
            gpu.sync()?;
            staged_ms.push(started.elapsed().as_secs_f64() * 1e3);
        }
        // The peer dies; a receive from it must end, through the watchdog, not hang.
        peer.kill().context("killing rank 1")?;
        let _ = peer.wait();
        let trip_after = std::time::Duration::from_secs(2);
        let tripper = {
            let abort = abort.clone();
            std::thread::spawn(move || {
                std::thread::sleep(trip_after);
                abort.abort();
            })
        };
        let started = Instant::now();
        let deadline = started + args.timeout();
        let outcome = link
            .recv(&mut back, n, deadline)
            .and_then(|()| link.wait(deadline));
        let abort_s = started.elapsed().as_secs_f64();
        let _ = tripper.join();
        let abort_error = match outcome {
            Ok(()) => bail!("a receive from a killed peer completed"),
            Err(e) => e.to_string(),
        };
        drop(link);
        // The device still works: a copy round trip after the abort.
        let probe: Vec<f32> = (0..1024).map(|i| pattern(99, i)).collect();
        let usable = gpu
            .upload(&probe)
            .and_then(|b| gpu.download(&b))
            .map(|v| v == probe)
            .unwrap_or(false);
        let bytes = (n * 4) as f64;
        let nccl_ms = median(&round_ms);
        let staged = median(&staged_ms);
        Ok(json!({
            "mib": bytes / (1024.0 * 1024.0),
            "round_trip_ms": round_ms,
            "nccl_gb_per_s": 2.0 * bytes / (nccl_ms * 1e-3) / 1e9,
            "host_copies_ms": staged_ms,
            "host_copies_gb_per_s": bytes / (staged * 1e-3) / 1e9,
            "bit_exact": bit_exact,
            "abort_tripped_after_s": trip_after.as_secs_f64(),
            "abort_s": abort_s,
            "abort_error": abort_error,
            "usable_after_abort": usable,
        }))
    }
}
