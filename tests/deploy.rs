//! The deploy files (deploy/): the Kubernetes manifests pass a real schema validator
//! (`kubernetes-validate --strict`, installed into .venv by scripts/test.sh) and agree with what
//! seqpipe relies on (agent flags that exist, the config they mount parses, secrets and ports
//! that match, a termination grace that covers the config's grace periods); the Slurm script passes
//! `shellcheck` and its `#SBATCH` lines request what a preemptible, requeued job needs.
//! A missing validator or shellcheck is a failure that says how to install it, never a skip.

mod common;

use std::collections::BTreeMap;
use std::path::{Path, PathBuf};
use std::process::Command;

use common::seqpipe;
use serde_json::Value;
use trainer::config::Config;

/// The Kubernetes version the manifests are validated against.
const KUBERNETES_VERSION: &str = "1.31.0";

fn repo() -> PathBuf {
    PathBuf::from(env!("CARGO_MANIFEST_DIR"))
}

/// `kubernetes-validate`: $SEQPIPE_KUBERNETES_VALIDATE, else the one scripts/test.sh installs.
fn validator() -> PathBuf {
    let path = std::env::var_os("SEQPIPE_KUBERNETES_VALIDATE")
        .map(PathBuf::from)
        .unwrap_or_else(|| repo().join(".venv/bin/kubernetes-validate"));
    assert!(
        path.is_file(),
        "{} is missing: run scripts/test.sh (it installs kubernetes-validate from PyPI into .venv), \
         or point SEQPIPE_KUBERNETES_VALIDATE at one",
        path.display()
    );
    path
}

/// The Python of the validator's venv (it has PyYAML, a dependency of kubernetes-validate).
fn venv_python() -> PathBuf {
    validator().with_file_name("python3")
}

fn manifests() -> Vec<PathBuf> {
    let mut files: Vec<PathBuf> = std::fs::read_dir(repo().join("deploy/kubernetes"))
        .unwrap()
        .map(|e| e.unwrap().path())
        .filter(|p| p.extension().is_some_and(|e| e == "yaml"))
        .collect();
    files.sort();
    assert!(!files.is_empty(), "no deploy/kubernetes/*.yaml");
    files
}

/// Runs the validator on `files`; returns (success, output).
fn validate(files: &[PathBuf]) -> (bool, String) {
    let out = Command::new(validator())
        .args(["--strict", "--quiet", "-k", KUBERNETES_VERSION])
        .args(files)
        .output()
        .expect("running kubernetes-validate");
    let text = format!(
        "{}{}",
        String::from_utf8_lossy(&out.stdout),
        String::from_utf8_lossy(&out.stderr)
    );
    (out.status.success(), text)
}

#[test]
fn kubernetes_manifests_pass_the_schema_validator() {
    let (ok, output) = validate(&manifests());
    assert!(ok, "kubernetes-validate --strict failed:\n{output}");
    // The validator is strict for real: a field the API does not have is refused.
    let bad = std::env::temp_dir().join(format!("seqpipe-deploy-bad-{}.yaml", std::process::id()));
    let agents = std::fs::read_to_string(repo().join("deploy/kubernetes/40-agents.yaml")).unwrap();
    std::fs::write(
        &bad,
        agents.replace(
            "podManagementPolicy: Parallel",
            "podManagementPolicy: Parallel\n  restartEverything: true",
        ),
    )
    .unwrap();
    let (ok, output) = validate(std::slice::from_ref(&bad));
    let _ = std::fs::remove_file(&bad);
    assert!(!ok && output.contains("restartEverything"), "{output}");
}

/// Every document of every manifest, as JSON (through the venv's PyYAML).
fn documents() -> Vec<Value> {
    let mut docs = Vec::new();
    for file in manifests() {
        let out = Command::new(venv_python())
            .args([
                "-c",
                "import json, sys, yaml; json.dump([d for d in yaml.safe_load_all(open(sys.argv[1])) if d], sys.stdout)",
            ])
            .arg(&file)
            .output()
            .expect("running the venv's python3");
        assert!(
            out.status.success(),
            "{}: {}",
            file.display(),
            String::from_utf8_lossy(&out.stderr)
        );
        let parsed: Vec<Value> = serde_json::from_slice(&out.stdout).unwrap();
        docs.extend(parsed);
    }
    docs
}

fn find<'a>(docs: &'a [Value], kind: &str, name: &str) -> &'a Value {
    docs.iter()
        .find(|d| d["kind"] == kind && d["metadata"]["name"] == name)
        .unwrap_or_else(|| panic!("no {kind} {name} in deploy/kubernetes"))
}

/// The flags `seqpipe <command> --help` lists.
fn help_flags(command: &[&str]) -> Vec<String> {
    let out = seqpipe()
        .args(command)
        .arg("--help")
        .output()
        .expect("running seqpipe --help");
    assert!(out.status.success(), "seqpipe {command:?} --help failed");
    String::from_utf8_lossy(&out.stdout)
        .split_whitespace()
        .filter(|w| w.starts_with('-'))
        .map(|w| w.trim_end_matches(',').to_string())
        .collect()
}

/// `labels` has every key/value of `selector`.
fn selects(selector: &Value, labels: &Value) -> bool {
    let selector = selector.as_object().expect("a label selector");
    !selector.is_empty() && selector.iter().all(|(k, v)| labels.get(k) == Some(v))
}

/// The port of a `host:port` (or `scheme://host:port/...`) address.
fn port_of(addr: &str) -> u64 {
    let authority = addr.split("://").last().unwrap().split('/').next().unwrap();
    authority.rsplit_once(':').unwrap().1.parse().unwrap()
}

#[test]
fn kubernetes_manifests_agree_with_seqpipe() {
    let docs = documents();
    // Everything in the job's namespace, which is created first.
    find(&docs, "Namespace", "seqpipe");
    for d in docs.iter().filter(|d| d["kind"] != "Namespace") {
        assert_eq!(d["metadata"]["namespace"], "seqpipe", "{}", d["metadata"]);
    }

    // The config the agents mount parses and validates.
    let config_map = find(&docs, "ConfigMap", "seqpipe-job");
    let job_toml = config_map["data"]["job.toml"].as_str().unwrap();
    let cfg = Config::from_toml(job_toml, "30-config.yaml").unwrap();
    cfg.validate().unwrap();

    let agents = find(&docs, "StatefulSet", "seqpipe-agent");
    let pod = &agents["spec"]["template"];
    let spec = &pod["spec"];
    let container = &spec["containers"][0];
    let args: Vec<&str> = container["args"]
        .as_array()
        .unwrap()
        .iter()
        .map(|a| a.as_str().unwrap())
        .collect();
    assert_eq!(args[0], "agent", "{args:?}");
    let flags = help_flags(&["agent"]);
    let arg = |flag: &str| {
        let i = args
            .iter()
            .position(|a| *a == flag)
            .unwrap_or_else(|| panic!("the agents run without {flag}: {args:?}"));
        args[i + 1]
    };
    for a in args.iter().filter(|a| a.starts_with("--")) {
        assert!(
            flags.iter().any(|f| f == a),
            "`seqpipe agent` has no {a}: {flags:?}"
        );
    }

    // The rendezvous: the config's, served by the etcd Service and its pod.
    assert_eq!(arg("--rendezvous"), cfg.elastic.rendezvous);
    let etcd_url = &cfg.elastic.rendezvous;
    let etcd_host = etcd_url["etcd://".len()..].split(':').next().unwrap();
    let etcd_service = find(&docs, "Service", etcd_host);
    let etcd_port = port_of(etcd_url);
    assert!(
        etcd_service["spec"]["ports"]
            .as_array()
            .unwrap()
            .iter()
            .any(|p| p["port"] == etcd_port),
        "the etcd Service does not serve port {etcd_port}"
    );
    let etcd = find(&docs, "StatefulSet", etcd_host);
    let etcd_pod = &etcd["spec"]["template"];
    assert!(selects(
        &etcd_service["spec"]["selector"],
        &etcd_pod["metadata"]["labels"]
    ));
    assert!(
        etcd_pod["spec"]["containers"][0]["ports"]
            .as_array()
            .unwrap()
            .iter()
            .any(|p| p["containerPort"] == etcd_port)
    );
    assert_eq!(etcd["spec"]["replicas"], 1, "documented as one member");

    // `--config` is the mounted ConfigMap's key.
    let config_path = Path::new(arg("--config"));
    let mount = container["volumeMounts"]
        .as_array()
        .unwrap()
        .iter()
        .find(|m| Path::new(m["mountPath"].as_str().unwrap()) == config_path.parent().unwrap())
        .expect("--config is not in a mounted volume");
    let volume = spec["volumes"]
        .as_array()
        .unwrap()
        .iter()
        .find(|v| v["name"] == mount["name"])
        .unwrap();
    assert_eq!(volume["configMap"]["name"], "seqpipe-job");
    let key = config_path.file_name().unwrap().to_str().unwrap();
    assert!(
        config_map["data"].get(key).is_some(),
        "no {key} in the ConfigMap"
    );

    // Secrets: the job token and the S3 credentials the checkpoint store needs exist.
    let env = container["env"].as_array().unwrap();
    let token = env
        .iter()
        .find(|e| e["name"] == "SEQPIPE_JOB_TOKEN")
        .expect("the agents get no SEQPIPE_JOB_TOKEN");
    let token_ref = &token["valueFrom"]["secretKeyRef"];
    let secret = find(&docs, "Secret", token_ref["name"].as_str().unwrap());
    let key = token_ref["key"].as_str().unwrap();
    assert!(!secret["stringData"][key].as_str().unwrap().is_empty());
    let mut from_secrets = BTreeMap::new();
    for source in container["envFrom"].as_array().unwrap() {
        let name = source["secretRef"]["name"].as_str().unwrap();
        for (k, v) in find(&docs, "Secret", name)["stringData"]
            .as_object()
            .unwrap()
        {
            from_secrets.insert(k.clone(), v.clone());
        }
    }
    if cfg.checkpoint.url.starts_with("s3://") {
        for key in ["AWS_ACCESS_KEY_ID", "AWS_SECRET_ACCESS_KEY"] {
            assert!(
                from_secrets.contains_key(key),
                "no {key} for {}",
                cfg.checkpoint.url
            );
        }
    }

    // A preempted pod gets the time to leave at a step boundary and, when it leads, to commit.
    let grace = spec["terminationGracePeriodSeconds"].as_f64().unwrap();
    assert!(
        grace >= cfg.elastic.grace_s + cfg.checkpoint.grace_s,
        "terminationGracePeriodSeconds {grace} < elastic.grace_s {} + checkpoint.grace_s {}",
        cfg.elastic.grace_s,
        cfg.checkpoint.grace_s
    );

    // The metrics port: the config's, the container's, the Service's, the scrape annotation's.
    let metrics_port = port_of(&cfg.elastic.metrics_listen);
    let named = container["ports"]
        .as_array()
        .unwrap()
        .iter()
        .find(|p| p["name"] == "metrics")
        .expect("no metrics container port");
    assert_eq!(named["containerPort"], metrics_port);
    assert_eq!(
        pod["metadata"]["annotations"]["prometheus.io/port"],
        metrics_port.to_string()
    );
    let service = find(
        &docs,
        "Service",
        agents["spec"]["serviceName"].as_str().unwrap(),
    );
    assert!(selects(
        &service["spec"]["selector"],
        &pod["metadata"]["labels"]
    ));
    assert!(
        service["spec"]["ports"]
            .as_array()
            .unwrap()
            .iter()
            .any(|p| p["port"] == metrics_port && p["targetPort"] == "metrics")
    );

    // Enough agents for the plan, and drains that leave at least elastic.min_nodes.
    let replicas = agents["spec"]["replicas"].as_u64().unwrap() as usize;
    assert!(replicas >= cfg.pipeline.stages.max(cfg.elastic.min_nodes));
    let pdb = find(&docs, "PodDisruptionBudget", "seqpipe-agent");
    assert!(selects(
        &pdb["spec"]["selector"]["matchLabels"],
        &pod["metadata"]["labels"]
    ));
    let unavailable = pdb["spec"]["maxUnavailable"].as_u64().unwrap() as usize;
    assert!(unavailable >= 1 && replicas - unavailable >= cfg.elastic.min_nodes);

    // The image runs the binary the Dockerfile builds.
    let dockerfile = std::fs::read_to_string(repo().join("deploy/Dockerfile")).unwrap();
    assert!(dockerfile.contains("cargo build --release --locked --bin seqpipe"));
    assert!(dockerfile.contains(r#"ENTRYPOINT ["/usr/local/bin/seqpipe"]"#));
}

/// `shellcheck`: $SEQPIPE_SHELLCHECK, else on PATH.
fn shellcheck() -> PathBuf {
    let path = std::env::var_os("SEQPIPE_SHELLCHECK")
        .map(PathBuf::from)
        .unwrap_or_else(|| PathBuf::from("shellcheck"));
    let found = Command::new(&path)
        .arg("--version")
        .output()
        .is_ok_and(|o| o.status.success());
    assert!(
        found,
        "shellcheck is missing: run scripts/test.sh (as root it installs the Debian package \
         shellcheck), `apt-get install shellcheck`, or set SEQPIPE_SHELLCHECK"
    );
    path
}

fn sbatch_path() -> PathBuf {
    repo().join("deploy/slurm/train.sbatch")
}

#[test]
fn sbatch_script_passes_shellcheck() {
    let out = Command::new(shellcheck())
        .args(["--shell=bash", "--severity=info"])
        .arg(sbatch_path())
        .output()
        .unwrap();
    assert!(
        out.status.success(),
        "shellcheck deploy/slurm/train.sbatch:\n{}",
        String::from_utf8_lossy(&out.stdout)
    );
}

/// The script's lines with their `\` continuations joined.
fn logical_lines(text: &str) -> Vec<String> {
    let mut lines = Vec::new();
    let mut current = String::new();
    for line in text.lines() {
        match line.strip_suffix('\\') {
            Some(head) => current.push_str(head),
            None => {
                current.push_str(line);
                lines.push(std::mem::take(&mut current));
            }
        }
    }
    lines
}

/// The flags (`-x`, `--xyz`) among the words of `text` (not words inside `$(...)`, like
/// `$(hostname -s)`, which end in a parenthesis).
fn flags_in(text: &str) -> Vec<String> {
    text.split_whitespace()
        .map(|w| w.trim_matches(|c| c == '\'' || c == '"'))
        .map(|w| w.split('=').next().unwrap())
        .filter(|w| {
            w.len() > 1
                && w.starts_with('-')
                && w.chars().all(|c| c.is_ascii_alphanumeric() || c == '-')
        })
        .map(String::from)
        .collect()
}

#[test]
fn sbatch_flags_are_the_ones_seqpipe_relies_on() {
    let text = std::fs::read_to_string(sbatch_path()).unwrap();
    let sbatch: BTreeMap<String, String> = text
        .lines()
        .filter_map(|l| l.strip_prefix("#SBATCH "))
        .map(|opt| {
            let (k, v) = opt.trim().split_once('=').unwrap_or((opt.trim(), ""));
            (k.to_string(), v.to_string())
        })
        .collect();
    assert!(sbatch.contains_key("--requeue"), "{sbatch:?}");
    assert_eq!(
        sbatch.get("--ntasks-per-node").map(String::as_str),
        Some("1")
    );
    assert_eq!(
        sbatch.get("--open-mode").map(String::as_str),
        Some("append")
    );
    // SIGTERM to the batch shell (`B:`), which relays it to the coordinator, early enough for a
    // node to leave at a step boundary and a final checkpoint to commit.
    let signal = sbatch.get("--signal").expect("no #SBATCH --signal");
    let seconds: f64 = signal
        .strip_prefix("B:TERM@")
        .unwrap_or_else(|| panic!("--signal={signal}: expected B:TERM@SECONDS"))
        .parse()
        .unwrap();
    let job = std::fs::read_to_string(repo().join("deploy/slurm/job.toml")).unwrap();
    let cfg = Config::from_toml(&job, "deploy/slurm/job.toml").unwrap();
    cfg.validate().unwrap();
    assert!(
        seconds >= cfg.elastic.grace_s + cfg.checkpoint.grace_s,
        "--signal gives {seconds} s < elastic.grace_s {} + checkpoint.grace_s {}",
        cfg.elastic.grace_s,
        cfg.checkpoint.grace_s
    );

    // The seqpipe command lines use flags that exist.
    let lines = logical_lines(&text);
    let line_with = |needle: &str| {
        lines
            .iter()
            .find(|l| l.contains(needle) && !l.trim_start().starts_with('#'))
            .unwrap_or_else(|| panic!("no line with {needle} in train.sbatch"))
            .clone()
    };
    let check = |command: &[&str], used: Vec<String>| {
        let known = help_flags(command);
        assert!(!used.is_empty());
        for flag in used {
            assert!(
                known.contains(&flag),
                "`seqpipe {}` has no {flag}",
                command.join(" ")
            );
        }
    };
    let agent = line_with(" agent --join");
    check(&["agent"], flags_in(agent.split(" agent ").nth(1).unwrap()));
    let train = line_with("start=(train");
    check(&["train"], flags_in(train.split("(train").nth(1).unwrap()));
    line_with("start=(resume \"$RUN_DIR\")");
    line_with("ckpt list");
    // The coordinator line's own flags, for `train` and `resume` alike.
    let coordinator = line_with("\"${start[@]}\"");
    let own = flags_in(coordinator.split("\"${start[@]}\"").nth(1).unwrap());
    check(&["train"], own.clone());
    check(&["resume"], own);
    // The keys it sets exist.
    let defaults: toml::Table = toml::from_str(&Config::default().to_toml()).unwrap();
    for set in coordinator.split("--set ").skip(1) {
        let key = set.trim_start_matches('"').split('=').next().unwrap();
        let (section, field) = key.split_once('.').unwrap();
        assert!(
            defaults.get(section).and_then(|s| s.get(field)).is_some(),
            "train.sbatch sets unknown key {key}"
        );
    }
    // The requeue that makes a preempted or failed job continue.
    assert!(text.contains("scontrol requeue \"$SLURM_JOB_ID\""));
    assert!(text.contains("trap on_term TERM"));
}
