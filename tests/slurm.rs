//! Slurm, for real: the test starts a one-node Slurm cluster on this machine (munged, slurmctld and
//! slurmd in the foreground, with a `slurm.conf` it writes into a temporary directory: ports on
//! 127.0.0.1, state, spool, pid and log files under that directory, the node as `slurmd -C`
//! describes this machine) and submits the shipped `deploy/slurm/train.sbatch`, set up only
//! through what a user sets too (`SEQPIPE`, `CONFIG`, `RUN_DIR`, `PORT`, `TMPDIR`, the job token,
//! `sbatch --nodes=1`). Three jobs of the same small config:
//!
//! * undisturbed: it trains to the end and commits its checkpoints; its final state is the
//!   reference;
//! * `scontrol requeue` mid-run: Slurm sends SIGTERM to every process of the job; the coordinator
//!   commits a checkpoint of the step it stopped at within the kill grace (`KillWait`), the job is
//!   requeued and resumes from exactly that step;
//! * SIGTERM to the batch shell only (`scancel --batch --signal=TERM`, which is how
//!   `--signal=B:TERM@N` delivers the time-limit and preemption warning): the script relays it to
//!   the coordinator, which commits its final checkpoint, requeues the job itself, and the job
//!   resumes from that checkpoint.
//!
//! Both disturbed jobs must end bit-identical (every parameter and optimizer tensor) to the
//! undisturbed one. A requeued job is held for about two minutes (Slurm sets its begin time);
//! the test, as an operator may, releases it with `scontrol update StartTime=now`.
//!
//! Needs root (slurmd runs jobs as their user and slurmctld as SlurmUser=root) and the Debian
//! packages slurm-wlm and munge: scripts/test.sh installs them as root. The test fails (never
//! skips) without them.

mod common;

use std::collections::BTreeMap;
use std::fmt::Write as _;
use std::io::Read;
use std::os::unix::fs::PermissionsExt;
use std::path::{Path, PathBuf};
use std::process::{Child, Command, Output, Stdio};
use std::time::{Duration, Instant};

use common::{
    checkpoint_steps, ckpt_url, effective_uid, final_state, free_port, fresh_dir, run_events,
    steps_done,
};
use trainer::runtime::events::{Record, RunEvent};

/// Steps of each job: enough that a disturbance after step `DISTURB_AFTER` lands well before the
/// end even when the stop takes a few steps on a busy machine.
const STEPS: u64 = 40;
/// Periodic checkpoints: a stop between two of them loses work unless the final checkpoint of
/// the stop is committed.
const EVERY: u64 = 10;
/// The disturbance comes once the job has done this many steps (between two periodic checkpoints).
const DISTURB_AFTER: usize = 12;
/// Slurm's grace between SIGTERM and SIGKILL when it kills a job (requeue, cancel).
const KILL_WAIT_S: u64 = 30;
/// The longest a job may take to get from one state to the next on a busy machine.
const JOB_TIMEOUT: Duration = Duration::from_secs(240);

/// The job's config (`CONFIG=`): a small model (tens of milliseconds a step), one node, and
/// grace periods that fit in `KILL_WAIT_S`.
fn job_config() -> String {
    format!(
        "[model]\nvocab_size = 128\nlayers = 4\nd_model = 64\nheads = 4\nmax_seq_len = 64\n\n\
         [train]\nsteps = {STEPS}\nseq_len = 64\nmicro_batch_size = 4\neval_every = 0\n\n\
         [checkpoint]\nevery = {EVERY}\nkeep_last = 2\ngrace_s = 20.0\n\n\
         [elastic]\nmin_nodes = 1\ngrace_s = 5.0\n"
    )
}

fn repo() -> PathBuf {
    PathBuf::from(env!("CARGO_MANIFEST_DIR"))
}

/// Panics unless the test runs as root.
fn require_root() {
    let euid = effective_uid();
    assert!(
        euid == "0",
        "tests/slurm.rs needs root (it runs slurmctld, slurmd and munged, and slurmd runs the jobs); \
         run it as root, e.g. `sudo -E cargo test --release --test slurm` (effective uid is {euid})"
    );
}

/// The path of Slurm or MUNGE program `name`: on PATH, or in /usr/sbin or /sbin (daemons).
fn program(name: &str) -> PathBuf {
    let path = std::env::var_os("PATH").unwrap_or_default();
    std::env::split_paths(&path)
        .chain(["/usr/sbin", "/sbin", "/usr/bin"].map(PathBuf::from))
        .map(|dir| dir.join(name))
        .find(|p| p.is_file())
        .unwrap_or_else(|| {
            panic!(
                "`{name}` not found on PATH, in /usr/sbin or /sbin: tests/slurm.rs needs the Debian \
                 packages slurm-wlm and munge (scripts/test.sh installs them as root; or \
                 `apt-get install -y --no-install-recommends slurm-wlm munge`)"
            )
        })
}

/// The last `lines` lines of a file, or a note that it cannot be read.
fn tail(path: &Path, lines: usize) -> String {
    match std::fs::read_to_string(path) {
        Ok(text) => {
            let all: Vec<&str> = text.lines().collect();
            all[all.len().saturating_sub(lines)..].join("\n")
        }
        Err(e) => format!("({}: {e})", path.display()),
    }
}

/// Seconds since the Unix epoch.
fn unix_s() -> u64 {
    std::time::SystemTime::now()
        .duration_since(std::time::UNIX_EPOCH)
        .unwrap()
        .as_secs()
}

/// Sends SIGTERM to `child`, waits up to 10 s, then kills it.
fn stop(child: &mut Child) {
    let _ = Command::new("kill")
        .args(["-TERM", &child.id().to_string()])
        .status();
    let started = Instant::now();
    while started.elapsed() < Duration::from_secs(10) {
        if let Ok(Some(_)) = child.try_wait() {
            return;
        }
        std::thread::sleep(Duration::from_millis(100));
    }
    let _ = child.kill();
    let _ = child.wait();
}

/// A one-node Slurm cluster whose every file is under `dir`. Dropping it cancels its jobs and
/// stops the daemons.
struct Cluster {
    dir: PathBuf,
    conf: PathBuf,
    /// munged, slurmctld, slurmd (stopped in reverse order).
    daemons: Vec<(&'static str, Child)>,
}

impl Cluster {
    fn start(dir: &Path) -> Self {
        let dir = dir.to_path_buf();
        for sub in ["state", "spool", "log"] {
            std::fs::create_dir_all(dir.join(sub)).unwrap();
        }
        let mut cluster = Cluster {
            conf: dir.join("slurm.conf"),
            dir,
            daemons: Vec::new(),
        };
        let dir = cluster.dir.clone();

        // MUNGE, which authenticates every Slurm message: a fresh key, its own socket.
        let key = dir.join("munge.key");
        let mut random = vec![0u8; 1024];
        std::fs::File::open("/dev/urandom")
            .and_then(|mut f| f.read_exact(&mut random))
            .expect("reading /dev/urandom for the munge key");
        std::fs::write(&key, &random).unwrap();
        // munged refuses a key that others may read.
        std::fs::set_permissions(&key, std::fs::Permissions::from_mode(0o400)).unwrap();
        let socket = dir.join("munge.sock");
        let munged = Command::new(program("munged"))
            .arg("--foreground")
            .arg("--force")
            .arg(format!("--key-file={}", key.display()))
            .arg(format!("--socket={}", socket.display()))
            .arg(format!("--pid-file={}", dir.join("munged.pid").display()))
            .arg(format!(
                "--log-file={}",
                dir.join("log/munged.log").display()
            ))
            .arg(format!("--seed-file={}", dir.join("munge.seed").display()))
            .stdout(Stdio::null())
            .stderr(std::fs::File::create(dir.join("log/munged.out")).unwrap())
            .spawn()
            .expect("starting munged");
        cluster.daemons.push(("munged", munged));
        cluster.wait_until("munged's socket", Duration::from_secs(30), || {
            socket.exists()
        });

        // This machine as `slurmd -C` describes it (name, CPUs, sockets, memory).
        let node = cluster.output(Command::new(program("slurmd")).arg("-C"));
        let node = node
            .lines()
            .find(|l| l.starts_with("NodeName="))
            .unwrap_or_else(|| panic!("`slurmd -C` printed no NodeName= line:\n{node}"))
            .to_string();
        let host = node
            .split_whitespace()
            .next()
            .and_then(|w| w.strip_prefix("NodeName="))
            .unwrap()
            .to_string();
        let (ctld_port, slurmd_port) = (free_port(), free_port());
        let d = dir.display();
        let conf = format!(
            "# A one-node cluster for tests/slurm.rs.\n\
             ClusterName=seqpipe-test\n\
             SlurmctldHost={host}(127.0.0.1)\n\
             SlurmctldPort={ctld_port}\n\
             SlurmdPort={slurmd_port}\n\
             SlurmUser=root\n\
             SlurmdUser=root\n\
             AuthType=auth/munge\n\
             CredType=cred/munge\n\
             AuthInfo=socket={}\n\
             StateSaveLocation={d}/state\n\
             SlurmdSpoolDir={d}/spool\n\
             SlurmctldPidFile={d}/slurmctld.pid\n\
             SlurmdPidFile={d}/slurmd.pid\n\
             SlurmctldLogFile={d}/log/slurmctld.log\n\
             SlurmdLogFile={d}/log/slurmd.log\n\
             ProctrackType=proctrack/linuxproc\n\
             TaskPlugin=task/none\n\
             SelectType=select/cons_tres\n\
             SelectTypeParameters=CR_CPU\n\
             SchedulerType=sched/backfill\n\
             AccountingStorageType=accounting_storage/none\n\
             JobAcctGatherType=jobacct_gather/none\n\
             JobCompType=jobcomp/none\n\
             MpiDefault=none\n\
             ReturnToService=2\n\
             KillWait={KILL_WAIT_S}\n\
             {node} NodeAddr=127.0.0.1 State=UNKNOWN\n\
             PartitionName=test Nodes={host} Default=YES MaxTime=INFINITE State=UP\n",
            socket.display()
        );
        std::fs::write(&cluster.conf, conf).unwrap();

        for (name, args) in [("slurmctld", &["-D", "-i"][..]), ("slurmd", &["-D"][..])] {
            let mut cmd = Command::new(program(name));
            cluster.slurm_env(&mut cmd);
            let child = cmd
                .args(args)
                .stdout(Stdio::null())
                .stderr(std::fs::File::create(dir.join(format!("log/{name}.out"))).unwrap())
                .spawn()
                .unwrap_or_else(|e| panic!("starting {name}: {e}"));
            cluster.daemons.push((name, child));
        }
        // The node registers and becomes idle.
        cluster.wait_until("the node to be idle", Duration::from_secs(60), || {
            cluster.node_state() == "idle"
        });
        cluster
    }

    /// The node's state as `sinfo` prints it (`idle`, `allocated`, `completing`, …), or "" when
    /// sinfo fails.
    fn node_state(&self) -> String {
        self.command("sinfo")
            .args(["-h", "-o", "%T"])
            .output()
            .map(|o| String::from_utf8_lossy(&o.stdout).trim().to_string())
            .unwrap_or_default()
    }

    /// Points a Slurm command at this cluster (and at nothing inherited from a job around the test).
    fn slurm_env(&self, cmd: &mut Command) {
        for (key, _) in std::env::vars_os() {
            if key.to_string_lossy().starts_with("SLURM_") {
                cmd.env_remove(key);
            }
        }
        cmd.env("SLURM_CONF", &self.conf);
    }

    /// A Slurm client command (`sbatch`, `scontrol`, …) of this cluster.
    fn command(&self, name: &str) -> Command {
        let mut cmd = Command::new(program(name));
        self.slurm_env(&mut cmd);
        cmd
    }

    /// What the daemons logged last, for failure messages.
    fn logs(&self) -> String {
        let mut text = String::new();
        for name in [
            "slurmctld.log",
            "slurmd.log",
            "slurmctld.out",
            "slurmd.out",
            "munged.out",
        ] {
            let _ = write!(
                text,
                "\n--- {name} ---\n{}",
                tail(&self.dir.join("log").join(name), 15)
            );
        }
        text
    }

    /// Runs `cmd`, panicking with its output and the daemons' logs unless it succeeds; its stdout.
    fn output(&self, cmd: &mut Command) -> String {
        let out: Output = cmd
            .output()
            .unwrap_or_else(|e| panic!("running {cmd:?}: {e}"));
        assert!(
            out.status.success(),
            "{cmd:?} failed ({}):\nstdout:\n{}\nstderr:\n{}{}",
            out.status,
            String::from_utf8_lossy(&out.stdout),
            String::from_utf8_lossy(&out.stderr),
            self.logs()
        );
        String::from_utf8_lossy(&out.stdout).into_owned()
    }

    /// Polls `done` every 0.2 s; panics with the daemons' logs after `timeout`.
    fn wait_until(&self, what: &str, timeout: Duration, mut done: impl FnMut() -> bool) {
        let started = Instant::now();
        while !done() {
            assert!(
                started.elapsed() < timeout,
                "waited {timeout:?} for {what}{}",
                self.logs()
            );
            std::thread::sleep(Duration::from_millis(200));
        }
    }

    /// `scontrol show job -o ID` as a map of its fields.
    fn job(&self, id: &str) -> BTreeMap<String, String> {
        let line = self.output(self.command("scontrol").args(["show", "job", "-o", id]));
        line.split_whitespace()
            .filter_map(|kv| kv.split_once('='))
            .map(|(k, v)| (k.to_string(), v.to_string()))
            .collect()
    }

    /// Waits until job `id` satisfies `pred`; panics with its fields, output and the daemons' logs
    /// after [`JOB_TIMEOUT`].
    fn wait_job(
        &self,
        job: &Job,
        what: &str,
        pred: impl Fn(&BTreeMap<String, String>) -> bool,
    ) -> BTreeMap<String, String> {
        let started = Instant::now();
        loop {
            let fields = self.job(&job.id);
            if pred(&fields) {
                return fields;
            }
            assert!(
                started.elapsed() < JOB_TIMEOUT,
                "job {} ({}): waited {JOB_TIMEOUT:?} for {what}; now {fields:?}\n--- job output ---\n{}{}",
                job.id,
                job.name,
                tail(&job.out, 40),
                self.logs()
            );
            std::thread::sleep(Duration::from_millis(250));
        }
    }

    /// Submits the shipped `deploy/slurm/train.sbatch` as a user would, with its own run directory.
    fn submit(&self, name: &'static str, config: &Path) -> Job {
        let work = self.dir.join(name);
        std::fs::create_dir_all(&work).unwrap();
        let run_dir = work.join("run");
        let mut sbatch = self.command("sbatch");
        sbatch
            .current_dir(&work)
            .args(["--parsable", "--nodes=1"])
            .arg(repo().join("deploy/slurm/train.sbatch"))
            .env("SEQPIPE", env!("CARGO_BIN_EXE_seqpipe"))
            .env("CONFIG", config)
            .env("RUN_DIR", &run_dir)
            .env("PORT", free_port().to_string())
            .env("TMPDIR", &work)
            .env("SEQPIPE_JOB_TOKEN", format!("slurm-test-{name}"))
            .env("RAYON_NUM_THREADS", "1")
            .env("CANDLE_NUM_THREADS", "1");
        let id = self.output(&mut sbatch).trim().to_string();
        assert!(
            !id.is_empty() && id.chars().all(|c| c.is_ascii_digit()),
            "sbatch --parsable printed {id:?}, not a job id"
        );
        Job {
            out: work.join(format!("seqpipe-{id}.out")),
            id,
            name,
            run_dir,
        }
    }

    /// Waits for job `job` to complete (exit 0:0) after `restarts` requeues; returns its output.
    fn wait_completed(&self, job: &Job, restarts: u32) -> String {
        let fields = self.wait_job(job, "the job to end", |f| {
            f.get("JobState").is_some_and(|s| {
                !matches!(
                    s.as_str(),
                    "PENDING" | "RUNNING" | "COMPLETING" | "CONFIGURING" | "REQUEUED"
                )
            })
        });
        let out = std::fs::read_to_string(&job.out).unwrap_or_default();
        assert_eq!(
            (
                fields["JobState"].as_str(),
                fields["ExitCode"].as_str(),
                fields["Restarts"].as_str()
            ),
            ("COMPLETED", "0:0", restarts.to_string().as_str()),
            "job {} ({}): {fields:?}\n--- job output ---\n{out}{}",
            job.id,
            job.name,
            self.logs()
        );
        assert!(
            out.contains("seqpipe: training finished"),
            "job {} ({}) did not report the end of training:\n{out}",
            job.id,
            job.name
        );
        out
    }
}

impl Drop for Cluster {
    fn drop(&mut self) {
        // Jobs first (their step daemons outlive slurmd), then the daemons.
        let _ = self.command("scancel").args(["--user=root"]).status();
        let started = Instant::now();
        while started.elapsed() < Duration::from_secs(KILL_WAIT_S + 15) {
            let queued = self
                .command("squeue")
                .args(["-h", "-o", "%i"])
                .output()
                .map(|o| String::from_utf8_lossy(&o.stdout).trim().to_string());
            if !matches!(queued, Ok(q) if !q.is_empty()) {
                break;
            }
            std::thread::sleep(Duration::from_millis(500));
        }
        while let Some((_, mut child)) = self.daemons.pop() {
            stop(&mut child);
        }
    }
}

/// A submitted job.
struct Job {
    id: String,
    name: &'static str,
    run_dir: PathBuf,
    /// Its output file (`#SBATCH --output=seqpipe-%j.out`, in the submit directory).
    out: PathBuf,
}

/// How a running job is disturbed.
#[derive(Clone, Copy, Debug)]
enum Disturbance {
    /// `scontrol requeue`: Slurm kills the job (SIGTERM to every process, SIGKILL after KillWait)
    /// and queues it again.
    Requeue,
    /// SIGTERM to the batch shell only, as `--signal=B:TERM@N` delivers it before the time limit
    /// or on preemption: the script stops the run and requeues the job itself.
    BatchSigterm,
}

/// The steps of the periodic checkpoints of a run of `steps` steps that started at `from`.
fn periodic(from: u64, steps: u64) -> Vec<u64> {
    (from + 1..=steps).filter(|s| s % EVERY == 0).collect()
}

/// The committed checkpoint steps a run's `metrics.jsonl` records, in order.
fn committed(run_dir: &Path) -> Vec<u64> {
    checkpoint_steps(&run_events(run_dir))
}

/// Submits a job, disturbs it after [`DISTURB_AFTER`] steps, and checks that it stopped with a
/// checkpoint of the step it reached, was requeued, resumed from exactly that checkpoint and ended
/// bit-identical to `reference`.
fn disturbed_job(
    cluster: &Cluster,
    config: &Path,
    how: Disturbance,
    name: &'static str,
    reference: &BTreeMap<String, Vec<u8>>,
) {
    let job = cluster.submit(name, config);
    cluster.wait_until(
        &format!("job {} ({name}) to do {DISTURB_AFTER} steps", job.id),
        JOB_TIMEOUT,
        || steps_done(&job.run_dir) >= DISTURB_AFTER,
    );
    let done_before = steps_done(&job.run_dir) as u64;
    match how {
        Disturbance::Requeue => {
            cluster.output(cluster.command("scontrol").args(["requeue", &job.id]));
        }
        Disturbance::BatchSigterm => {
            cluster.output(
                cluster
                    .command("scancel")
                    .args(["--batch", "--signal=TERM", &job.id]),
            );
        }
    }
    // Requeued: pending again, held by the begin time Slurm gives a requeued job (about two
    // minutes). Released here as an operator would, to keep the test short, once the first run
    // has left the node, and in a later second than it ended: slurmd refuses a credential issued
    // in the second its job was revoked ("Job credential revoked").
    let fields = cluster.wait_job(&job, "the job to be requeued", |f| {
        f.get("Restarts").map(String::as_str) == Some("1")
            && f.get("JobState").map(String::as_str) == Some("PENDING")
    });
    println!(
        "{name}: job {} requeued after {how:?}: {} (reason {})",
        job.id, fields["JobState"], fields["Reason"]
    );
    cluster.wait_until("the node to be idle again", JOB_TIMEOUT, || {
        cluster.node_state() == "idle"
    });
    let idle_at = unix_s();
    while unix_s() < idle_at + 2 {
        std::thread::sleep(Duration::from_millis(100));
    }
    cluster.output(cluster.command("scontrol").args([
        "update",
        &format!("JobId={}", job.id),
        "StartTime=now",
    ]));
    let out = cluster.wait_completed(&job, 1);

    // The first run stopped at step `stopped` with a committed checkpoint of it, and the requeued
    // run resumed from exactly there: no step was lost to the disturbance.
    let records = common::records(&job.run_dir);
    let resumed_at = records
        .iter()
        .position(|r| matches!(r, Record::Event(RunEvent::Resumed(_))))
        .unwrap_or_else(|| panic!("{name}: no `resumed` event in metrics.jsonl:\n{out}"));
    let Record::Event(RunEvent::Resumed(resumed)) = &records[resumed_at] else {
        unreachable!()
    };
    let before = &records[..resumed_at];
    let stopped = before
        .iter()
        .filter_map(|r| match r {
            Record::Step(s) => Some(s.step),
            _ => None,
        })
        .max()
        .unwrap_or_else(|| panic!("{name}: no step before the requeue:\n{out}"));
    let checkpoints_before: Vec<u64> = before
        .iter()
        .filter_map(|r| match r {
            Record::Event(RunEvent::Checkpoint(c)) => Some(c.step),
            _ => None,
        })
        .collect();
    println!(
        "{name}: stopped after step {stopped} (checkpoints {checkpoints_before:?}), resumed from step {}",
        resumed.step
    );
    // The job had done `done_before` steps when it was disturbed; a resume from an earlier step
    // means the first run committed no checkpoint of the step it stopped at (a resumed run
    // rewrites metrics.jsonl from its checkpoint on, so the lost steps leave no records).
    assert!(
        resumed.step >= done_before,
        "{name}: the requeued job resumed from step {}, but the job had done {done_before} steps \
         when it was disturbed: the first run committed no checkpoint of the step it stopped at \
         (it committed {checkpoints_before:?})\n{out}",
        resumed.step
    );
    assert!(
        stopped < STEPS,
        "{name}: the first run ended at step {stopped}, not mid-run:\n{out}"
    );
    assert_eq!(
        checkpoints_before.last(),
        Some(&stopped),
        "{name}: the first run did not commit a checkpoint of the step it stopped at ({stopped}) \
         within its grace; it committed {checkpoints_before:?}\n{out}"
    );
    assert_eq!(
        resumed.step, stopped,
        "{name}: the requeued job resumed from step {} instead of the step the first run \
         stopped at ({stopped}):\n{out}",
        resumed.step
    );
    assert!(
        out.contains("(restart 1)") && out.contains(&format!("resumed from step {stopped}")),
        "{name}: the requeued run's output does not show a resume from step {stopped}:\n{out}"
    );
    if matches!(how, Disturbance::BatchSigterm) {
        assert!(
            out.contains("seqpipe: requeueing job") && out.contains("stopped by signal 15"),
            "{name}: the script did not stop the coordinator on SIGTERM and requeue the job:\n{out}"
        );
    }
    // Every periodic checkpoint after the resume, then the last step.
    let after: Vec<u64> = records[resumed_at..]
        .iter()
        .filter_map(|r| match r {
            Record::Event(RunEvent::Checkpoint(c)) => Some(c.step),
            _ => None,
        })
        .collect();
    assert_eq!(after, periodic(stopped, STEPS), "{name}: {out}");

    let (step, state) = final_state(&ckpt_url(&job.run_dir));
    assert_eq!(step, STEPS, "{name}");
    assert!(
        &state == reference,
        "{name}: the final state after the requeue differs from the undisturbed job's"
    );
    println!(
        "{name}: final state of step {STEPS} bit-identical to the undisturbed job ({} tensors)",
        state.len()
    );
}

#[test]
fn sbatch_trains_and_a_requeue_or_batch_sigterm_resumes_bit_identically() {
    require_root();
    let started = Instant::now();
    let dir = fresh_dir("slurm");
    let cluster = Cluster::start(&dir);
    println!("cluster up in {:.1} s", started.elapsed().as_secs_f64());
    let config = dir.join("job.toml");
    std::fs::write(&config, job_config()).unwrap();

    // Undisturbed: trains to the end, commits every periodic checkpoint.
    let job = cluster.submit("undisturbed", &config);
    let out = cluster.wait_completed(&job, 0);
    assert!(
        !out.contains("requeueing"),
        "the undisturbed job was requeued:\n{out}"
    );
    assert_eq!(committed(&job.run_dir), periodic(0, STEPS), "{out}");
    let (step, reference) = final_state(&ckpt_url(&job.run_dir));
    assert_eq!(step, STEPS);
    assert!(!reference.is_empty());
    println!(
        "undisturbed: job {} committed checkpoints {:?} ({:.1} s so far)",
        job.id,
        committed(&job.run_dir),
        started.elapsed().as_secs_f64()
    );

    disturbed_job(
        &cluster,
        &config,
        Disturbance::Requeue,
        "requeue",
        &reference,
    );
    disturbed_job(
        &cluster,
        &config,
        Disturbance::BatchSigterm,
        "batch-sigterm",
        &reference,
    );
    println!("done in {:.1} s", started.elapsed().as_secs_f64());
}
