//! Local agents (`elastic.local_agents`): one `seqpipe agent --local` process per worker on the
//! coordinator's machine, logging under the run directory, in their own process group and ended
//! with the coordinator.

use std::process::{Command, Stdio};

use elastic::NodeId;

use super::super::auth;
use super::super::error::LaunchError;
use super::Coordinator;

impl Coordinator {
    pub(super) fn spawn_local_agent(&mut self, name: &str) -> Result<(), LaunchError> {
        let exe = std::env::current_exe().map_err(|source| LaunchError::Io {
            what: "locating the seqpipe executable".into(),
            source,
        })?;
        let logs = self.cfg.run.dir.join(&self.session).join("logs");
        let io = |what: String| {
            move |source| LaunchError::Io {
                what: what.clone(),
                source,
            }
        };
        std::fs::create_dir_all(&logs).map_err(io(format!("creating {}", logs.display())))?;
        let log = logs.join(format!("agent-{name}.log"));
        // Appended to: an agent started again under the same name keeps its predecessor's log.
        let file = super::super::agent::append_log(&log, &format!("agent {name}"))
            .map_err(io(format!("opening {}", log.display())))?;
        let stderr = file.try_clone().map_err(io("agent log".into()))?;
        let mut cmd = Command::new(exe);
        cmd.args([
            "agent", "--join", &self.addr, "--name", name, "--slots", "1", "--local",
        ])
        .arg("--dir")
        .arg(&self.cfg.run.dir)
        .args(preemption_args(&self.cfg.elastic))
        .env(auth::TOKEN_ENV, &self.token)
        .stdin(Stdio::null())
        .stdout(Stdio::from(file))
        .stderr(Stdio::from(stderr));
        if std::env::var_os("RUST_LOG").is_none() {
            cmd.env("RUST_LOG", &self.cfg.run.log);
        }
        // Own process group (a Ctrl-C reaches only the launcher, which stops the run cleanly), and
        // no agent outlives the launcher.
        std::os::unix::process::CommandExt::process_group(&mut cmd, 0);
        super::super::agent::die_with_parent(&mut cmd);
        let child = cmd.spawn().map_err(|source| LaunchError::Io {
            what: format!("starting local agent {name}"),
            source,
        })?;
        self.local_agents.push(child);
        self.local_names.insert(NodeId::new(name));
        Ok(())
    }

    /// A local agent that exited before joining is an error with its status.
    pub(super) fn check_local_agents(&mut self) -> Result<(), LaunchError> {
        for child in &mut self.local_agents {
            if let Ok(Some(status)) = child.try_wait()
                && self.state.current.is_none()
            {
                return Err(LaunchError::Run(format!(
                    "a local agent exited before the run started ({status}); see the logs in {}",
                    self.cfg.run.dir.join("logs").display()
                )));
            }
        }
        Ok(())
    }

    pub(super) fn kill_local_agents(&mut self) {
        for child in &mut self.local_agents {
            let _ = child.kill();
            let _ = child.wait();
        }
    }
}

/// The `seqpipe agent` flags that carry `elastic.preemption_notice`, `metadata_endpoint` and
/// `metadata_poll_s` to a local agent.
pub(super) fn preemption_args(elastic: &elastic::ElasticConfig) -> Vec<String> {
    let mut args = vec![
        "--preemption-notice".to_string(),
        elastic.preemption_notice.to_string(),
        "--metadata-poll-s".to_string(),
        elastic.metadata_poll_s.to_string(),
    ];
    if !elastic.metadata_endpoint.is_empty() {
        args.extend([
            "--metadata-endpoint".to_string(),
            elastic.metadata_endpoint.clone(),
        ]);
    }
    args
}
