//! What a cloud's instance metadata service answers about this instance being reclaimed, read
//! strictly: one pure function per documented answer, from (status, headers, body) to "no
//! notice", a [`Notice`], or a [`BadAnswer`] saying what was wrong. No I/O; the answers are
//! untrusted input, so every field is checked and every string bounded before it is kept.

use std::fmt;
use std::str::FromStr;

use serde::{Deserialize, Serialize};
use thiserror::Error;

/// The clouds whose preemption notices an agent can watch for.
#[derive(Clone, Copy, Debug, PartialEq, Eq, Serialize, Deserialize)]
#[serde(rename_all = "lowercase")]
pub enum Cloud {
    /// AWS EC2 spot instances: the `spot/instance-action` item of IMDSv2.
    Aws,
    /// Google Compute Engine spot and preemptible VMs: the `instance/preempted` item.
    Gcp,
    /// Azure spot VMs: a `Preempt` event of the Scheduled Events service.
    Azure,
}

impl Cloud {
    /// The metadata service's documented address.
    pub fn default_endpoint(self) -> &'static str {
        match self {
            Cloud::Aws | Cloud::Azure => "http://169.254.169.254",
            Cloud::Gcp => "http://metadata.google.internal",
        }
    }
}

impl fmt::Display for Cloud {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        f.write_str(match self {
            Cloud::Aws => "aws",
            Cloud::Gcp => "gcp",
            Cloud::Azure => "azure",
        })
    }
}

/// `elastic.preemption_notice` / `seqpipe agent --preemption-notice`: which cloud's metadata
/// service to watch, or none.
#[derive(Clone, Copy, Debug, Default, PartialEq, Eq, Serialize, Deserialize)]
#[serde(rename_all = "lowercase")]
pub enum NoticeSource {
    /// Watch nothing: only SIGTERM is a preemption notice.
    #[default]
    Off,
    /// AWS spot (IMDSv2).
    Aws,
    /// Google Compute Engine.
    Gcp,
    /// Azure Scheduled Events.
    Azure,
}

impl NoticeSource {
    /// The cloud watched, if any.
    pub fn cloud(self) -> Option<Cloud> {
        match self {
            NoticeSource::Off => None,
            NoticeSource::Aws => Some(Cloud::Aws),
            NoticeSource::Gcp => Some(Cloud::Gcp),
            NoticeSource::Azure => Some(Cloud::Azure),
        }
    }
}

impl fmt::Display for NoticeSource {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        match self.cloud() {
            Some(cloud) => cloud.fmt(f),
            None => f.write_str("off"),
        }
    }
}

impl FromStr for NoticeSource {
    type Err = String;

    fn from_str(s: &str) -> Result<Self, Self::Err> {
        match s {
            "off" => Ok(NoticeSource::Off),
            "aws" => Ok(NoticeSource::Aws),
            "gcp" => Ok(NoticeSource::Gcp),
            "azure" => Ok(NoticeSource::Azure),
            other => Err(format!(
                "`{other}` is not a preemption notice source; use aws, gcp, azure or off"
            )),
        }
    }
}

/// What AWS will do to a spot instance (`spot/instance-action`'s `action`).
#[derive(Clone, Copy, Debug, PartialEq, Eq, Serialize, Deserialize)]
#[serde(rename_all = "lowercase")]
pub enum SpotAction {
    /// The instance is terminated.
    Terminate,
    /// The instance is stopped.
    Stop,
    /// The instance is hibernated.
    Hibernate,
}

impl fmt::Display for SpotAction {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        f.write_str(match self {
            SpotAction::Terminate => "terminate",
            SpotAction::Stop => "stop",
            SpotAction::Hibernate => "hibernate",
        })
    }
}

/// A cloud's notice that this instance is about to be reclaimed. Its `Display` is the reason
/// the node leaves the run ("aws spot instance-action terminate at 2026-11-23T08:22:00Z").
#[derive(Clone, Debug, PartialEq, Eq, Serialize, Deserialize)]
#[serde(tag = "cloud", rename_all = "lowercase")]
pub enum Notice {
    /// AWS: the spot instance gets `action` at `time` (UTC, `YYYY-MM-DDTHH:MM:SSZ`), two
    /// minutes after the notice.
    Aws {
        /// What happens to the instance.
        action: SpotAction,
        /// When, as AWS wrote it.
        time: String,
    },
    /// GCP: the instance is preempted (it is stopped about 30 s after the notice).
    Gcp,
    /// Azure: a `Preempt` scheduled event for this VM.
    Azure {
        /// The event's `EventId`.
        event_id: String,
        /// The event's `NotBefore` (RFC 1123, as Azure wrote it), empty once it has started.
        not_before: String,
    },
}

impl Notice {
    /// The cloud that sent it.
    pub fn cloud(&self) -> Cloud {
        match self {
            Notice::Aws { .. } => Cloud::Aws,
            Notice::Gcp => Cloud::Gcp,
            Notice::Azure { .. } => Cloud::Azure,
        }
    }

    /// When the instance goes, as the cloud said it (GCP says nothing: about 30 s).
    pub fn deadline(&self) -> String {
        match self {
            Notice::Aws { time, .. } => time.clone(),
            Notice::Gcp => "about 30 s after the notice (GCP gives no time)".into(),
            Notice::Azure { not_before, .. } if not_before.is_empty() => "now".into(),
            Notice::Azure { not_before, .. } => not_before.clone(),
        }
    }

    /// Checks a notice received from a peer (an agent tells the coordinator): the same bounds
    /// as when it was parsed from the cloud's answer.
    pub fn check(&self) -> Result<(), BadAnswer> {
        match self {
            Notice::Aws { time, .. } => utc_time("time", time).map(|_| ()),
            Notice::Gcp => Ok(()),
            Notice::Azure {
                event_id,
                not_before,
            } => {
                text("EventId", event_id, false)?;
                text("NotBefore", not_before, true).map(|_| ())
            }
        }
    }
}

impl fmt::Display for Notice {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        match self {
            Notice::Aws { action, time } => {
                write!(f, "aws spot instance-action {action} at {time}")
            }
            Notice::Gcp => f.write_str("gcp instance preempted"),
            Notice::Azure {
                event_id,
                not_before,
            } if not_before.is_empty() => {
                write!(f, "azure scheduled event Preempt {event_id}, started")
            }
            Notice::Azure {
                event_id,
                not_before,
            } => write!(
                f,
                "azure scheduled event Preempt {event_id} not before {not_before}"
            ),
        }
    }
}

/// The reason a node leaves at a step boundary: its cloud's notice, else SIGTERM (sent by a
/// person, a scheduler, or the cloud's own shutdown).
pub fn leave_reason(notice: Option<&Notice>) -> String {
    match notice {
        Some(notice) => format!("preemption notice ({notice})"),
        None => "preemption notice (SIGTERM)".into(),
    }
}

/// What was wrong with a metadata service's answer.
#[derive(Debug, Error, PartialEq, Eq)]
pub enum BadAnswer {
    /// A status the documentation does not give for this item.
    #[error("HTTP status {status}, expected {expected}")]
    Status {
        /// The status received.
        status: u16,
        /// The statuses the item can answer with.
        expected: &'static str,
    },
    /// The body is not the documented JSON document.
    #[error("the body is not the documented JSON ({0})")]
    Json(String),
    /// A field has a value out of its documented range or bounds.
    #[error("`{field}` {problem}")]
    Field {
        /// The field (or header, or body).
        field: &'static str,
        /// What was wrong with it.
        problem: String,
    },
    /// GCP's answer lacks `Metadata-Flavor: Google`: something else answered.
    #[error("no `Metadata-Flavor: Google` header in the answer: not the GCP metadata server")]
    NotGoogle,
    /// Not a valid HTTP answer at all (malformed, or over a size limit).
    #[error("{0}")]
    Http(String),
}

/// The longest string kept from an answer (event ids are GUIDs, times about 30 bytes).
pub const MAX_TEXT: usize = 256;

/// Most events read from one Scheduled Events document.
pub const MAX_EVENTS: usize = 100;

/// `s` if it is printable ASCII of at most [`MAX_TEXT`] bytes (empty only if `empty_ok`).
fn text<'a>(field: &'static str, s: &'a str, empty_ok: bool) -> Result<&'a str, BadAnswer> {
    let problem = if s.len() > MAX_TEXT {
        format!(
            "is {} bytes long, more than the {MAX_TEXT} accepted",
            s.len()
        )
    } else if s.is_empty() && !empty_ok {
        "is empty".into()
    } else if let Some(c) = s.chars().find(|c| !(c.is_ascii_graphic() || *c == ' ')) {
        format!("holds {c:?}, not printable ASCII")
    } else {
        return Ok(s);
    };
    Err(BadAnswer::Field { field, problem })
}

/// `s` if it is a UTC time in the form AWS writes (`2026-11-23T08:22:00Z`).
fn utc_time<'a>(field: &'static str, s: &'a str) -> Result<&'a str, BadAnswer> {
    let bad = || BadAnswer::Field {
        field,
        problem: format!(
            "`{}` is not a UTC time like 2026-11-23T08:22:00Z",
            s.chars().take(40).collect::<String>()
        ),
    };
    let b = s.as_bytes();
    if b.len() != 20 {
        return Err(bad());
    }
    let shape = b"dddd-dd-ddTdd:dd:ddZ";
    let shaped = b.iter().zip(shape).all(|(&c, &want)| match want {
        b'd' => c.is_ascii_digit(),
        _ => c == want,
    });
    if !shaped {
        return Err(bad());
    }
    let num = |range: std::ops::Range<usize>| s[range].parse::<u32>().unwrap_or(u32::MAX);
    let (month, day, hour, minute, second) =
        (num(5..7), num(8..10), num(11..13), num(14..16), num(17..19));
    let in_range = (1..=12).contains(&month)
        && (1..=31).contains(&day)
        && hour < 24
        && minute < 60
        && second <= 60;
    if in_range { Ok(s) } else { Err(bad()) }
}

/// The answer to AWS's `PUT /latest/api/token`: the IMDSv2 session token.
pub fn aws_token(status: u16, body: &[u8]) -> Result<String, BadAnswer> {
    if status != 200 {
        return Err(BadAnswer::Status {
            status,
            expected: "200 (is IMDSv2 enabled, and the hop limit high enough for containers?)",
        });
    }
    let body = std::str::from_utf8(body).map_err(|_| BadAnswer::Field {
        field: "token",
        problem: "is not UTF-8".into(),
    })?;
    let token = text("token", body.trim(), false)?;
    if token.contains(' ') {
        return Err(BadAnswer::Field {
            field: "token",
            problem: "holds a space".into(),
        });
    }
    Ok(token.to_string())
}

/// What AWS's `GET /latest/meta-data/spot/instance-action` said.
#[derive(Debug, PartialEq, Eq)]
pub enum AwsAnswer {
    /// 404: no action is scheduled.
    NoNotice,
    /// 200: the instance is reclaimed.
    Notice(Notice),
    /// 401: the session token expired or is not accepted; get a new one.
    TokenRejected,
}

/// The answer to AWS's `GET /latest/meta-data/spot/instance-action`.
pub fn aws_instance_action(status: u16, body: &[u8]) -> Result<AwsAnswer, BadAnswer> {
    #[derive(Deserialize)]
    struct InstanceAction {
        action: String,
        time: String,
    }
    match status {
        404 => return Ok(AwsAnswer::NoNotice),
        401 => return Ok(AwsAnswer::TokenRejected),
        200 => {}
        status => {
            return Err(BadAnswer::Status {
                status,
                expected: "200, 401 or 404",
            });
        }
    }
    let doc: InstanceAction =
        serde_json::from_slice(body).map_err(|e| BadAnswer::Json(e.to_string()))?;
    let action = match doc.action.as_str() {
        "terminate" => SpotAction::Terminate,
        "stop" => SpotAction::Stop,
        "hibernate" => SpotAction::Hibernate,
        other => {
            return Err(BadAnswer::Field {
                field: "action",
                problem: format!(
                    "is `{}`, not terminate, stop or hibernate",
                    other.chars().take(40).collect::<String>()
                ),
            });
        }
    };
    let time = utc_time("time", &doc.time)?.to_string();
    Ok(AwsAnswer::Notice(Notice::Aws { action, time }))
}

/// The answer to GCP's `GET /computeMetadata/v1/instance/preempted`: `TRUE` is a notice,
/// `FALSE` none. `google` says whether the answer carried `Metadata-Flavor: Google`.
pub fn gcp_preempted(status: u16, google: bool, body: &[u8]) -> Result<Option<Notice>, BadAnswer> {
    if !google {
        return Err(BadAnswer::NotGoogle);
    }
    if status != 200 {
        return Err(BadAnswer::Status {
            status,
            expected: "200",
        });
    }
    match body.trim_ascii() {
        b"TRUE" => Ok(Some(Notice::Gcp)),
        b"FALSE" => Ok(None),
        other => Err(BadAnswer::Field {
            field: "body",
            problem: format!(
                "is `{}`, neither TRUE nor FALSE",
                String::from_utf8_lossy(&other[..other.len().min(40)])
            ),
        }),
    }
}

/// An event of a Scheduled Events document that is not a preemption of this VM (a reboot, a
/// redeploy, a freeze, or another VM's event): logged, not acted on.
#[derive(Debug, PartialEq, Eq)]
pub struct OtherEvent {
    /// Its `EventId`.
    pub id: String,
    /// Its `EventType`.
    pub kind: String,
    /// Its `Resources` name this VM (else it is another VM's event).
    pub this_vm: bool,
}

/// What an Azure Scheduled Events document says.
#[derive(Debug, Default, PartialEq, Eq)]
pub struct AzureEvents {
    /// The first `Preempt` event for this VM, if any.
    pub preempt: Option<Notice>,
    /// The other events.
    pub others: Vec<OtherEvent>,
}

/// The answer to Azure's `GET /metadata/scheduledevents?api-version=2020-07-01`. A `Preempt`
/// event is for this VM when `vm_name` is among its `Resources` (or when the VM's name is not
/// known: then every `Preempt` counts, since leaving early costs less than being killed).
pub fn azure_events(
    status: u16,
    body: &[u8],
    vm_name: Option<&str>,
) -> Result<AzureEvents, BadAnswer> {
    #[derive(Deserialize)]
    #[serde(rename_all = "PascalCase")]
    struct Document {
        #[allow(dead_code)]
        document_incarnation: u64,
        events: Vec<Event>,
    }
    #[derive(Deserialize)]
    #[serde(rename_all = "PascalCase")]
    struct Event {
        event_id: String,
        event_type: String,
        #[serde(default)]
        resources: Vec<String>,
        event_status: String,
        #[serde(default)]
        not_before: String,
    }
    if status != 200 {
        return Err(BadAnswer::Status {
            status,
            expected: "200",
        });
    }
    let doc: Document = serde_json::from_slice(body).map_err(|e| BadAnswer::Json(e.to_string()))?;
    if doc.events.len() > MAX_EVENTS {
        return Err(BadAnswer::Field {
            field: "Events",
            problem: format!(
                "holds {} events, more than the {MAX_EVENTS} accepted",
                doc.events.len()
            ),
        });
    }
    let mut found = AzureEvents::default();
    for event in doc.events {
        let id = text("EventId", &event.event_id, false)?.to_string();
        let kind = text("EventType", &event.event_type, false)?.to_string();
        let not_before = text("NotBefore", &event.not_before, true)?.to_string();
        if !matches!(event.event_status.as_str(), "Scheduled" | "Started") {
            return Err(BadAnswer::Field {
                field: "EventStatus",
                problem: format!(
                    "is `{}`, neither Scheduled nor Started",
                    event.event_status.chars().take(40).collect::<String>()
                ),
            });
        }
        let this_vm = vm_name.is_none_or(|name| event.resources.iter().any(|r| r == name));
        if kind == "Preempt" && this_vm && found.preempt.is_none() {
            found.preempt = Some(Notice::Azure {
                event_id: id,
                not_before,
            });
        } else {
            found.others.push(OtherEvent { id, kind, this_vm });
        }
    }
    Ok(found)
}

/// The answer to Azure's `GET /metadata/instance/compute/name?api-version=2021-02-01&format=text`:
/// this VM's name, as Scheduled Events list it in `Resources`.
pub fn azure_vm_name(status: u16, body: &[u8]) -> Result<String, BadAnswer> {
    if status != 200 {
        return Err(BadAnswer::Status {
            status,
            expected: "200",
        });
    }
    let body = std::str::from_utf8(body).map_err(|_| BadAnswer::Field {
        field: "name",
        problem: "is not UTF-8".into(),
    })?;
    Ok(text("name", body.trim(), false)?.to_string())
}

#[cfg(test)]
mod tests {
    use super::*;

    fn field(result: Result<impl fmt::Debug, BadAnswer>) -> &'static str {
        match result {
            Err(BadAnswer::Field { field, .. }) => field,
            other => panic!("expected a bad field, got {other:?}"),
        }
    }

    #[test]
    fn aws_spot_instance_action_from_the_documentation() {
        // https://docs.aws.amazon.com/AWSEC2/latest/UserGuide/spot-instance-termination-notices.html
        let body = br#"{"action": "terminate", "time": "2017-09-18T08:22:00Z"}"#;
        let notice = Notice::Aws {
            action: SpotAction::Terminate,
            time: "2017-09-18T08:22:00Z".into(),
        };
        assert_eq!(
            aws_instance_action(200, body),
            Ok(AwsAnswer::Notice(notice.clone()))
        );
        assert_eq!(
            notice.to_string(),
            "aws spot instance-action terminate at 2017-09-18T08:22:00Z"
        );
        assert_eq!(notice.deadline(), "2017-09-18T08:22:00Z");
        assert_eq!(
            leave_reason(Some(&notice)),
            "preemption notice (aws spot instance-action terminate at 2017-09-18T08:22:00Z)"
        );
        for (action, want) in [
            ("stop", SpotAction::Stop),
            ("hibernate", SpotAction::Hibernate),
        ] {
            let body = format!(r#"{{"action":"{action}","time":"2026-11-23T08:22:00Z"}}"#);
            match aws_instance_action(200, body.as_bytes()) {
                Ok(AwsAnswer::Notice(Notice::Aws { action, .. })) => assert_eq!(action, want),
                other => panic!("{other:?}"),
            }
        }
        // IMDS's 404 page is HTML: no notice.
        let not_found = b"<?xml version=\"1.0\"?><html><title>404 - Not Found</title></html>";
        assert_eq!(aws_instance_action(404, not_found), Ok(AwsAnswer::NoNotice));
        assert_eq!(aws_instance_action(401, b""), Ok(AwsAnswer::TokenRejected));
    }

    #[test]
    fn aws_garbage_is_a_bad_answer() {
        assert!(matches!(
            aws_instance_action(500, b"oops"),
            Err(BadAnswer::Status { status: 500, .. })
        ));
        for body in [
            &b""[..],
            b"not json",
            b"[]",
            b"{\"action\":\"terminate\"}",
            b"{\"action\":7,\"time\":\"2026-11-23T08:22:00Z\"}",
            b"\xff\xfe",
        ] {
            assert!(
                matches!(aws_instance_action(200, body), Err(BadAnswer::Json(_))),
                "{}",
                String::from_utf8_lossy(body)
            );
        }
        let action = br#"{"action":"reboot","time":"2026-11-23T08:22:00Z"}"#;
        assert_eq!(field(aws_instance_action(200, action)), "action");
        for time in [
            "",
            "soon",
            "2026-11-23 08:22:00Z",
            "2026-13-23T08:22:00Z",
            "2026-11-23T25:22:00Z",
            "2026-11-23T08:22:00+01:00",
            "2026-11-23T08:22:00Zjunk",
            "２０２６-11-23T08:22:00Z",
        ] {
            let body = format!(r#"{{"action":"terminate","time":"{time}"}}"#);
            assert_eq!(field(aws_instance_action(200, body.as_bytes())), "time");
        }
    }

    #[test]
    fn aws_token_is_a_short_printable_string() {
        let token = "AQAEAPJ1nM9-6Z8Ov1jzM8bUe2GdpXnBQfiIrSfLC7D5-qbbIbaH_A==";
        assert_eq!(
            aws_token(200, format!("{token}\n").as_bytes()),
            Ok(token.into())
        );
        assert!(matches!(aws_token(403, b""), Err(BadAnswer::Status { .. })));
        assert_eq!(field(aws_token(200, b"")), "token");
        assert_eq!(field(aws_token(200, b"two words")), "token");
        assert_eq!(field(aws_token(200, b"bell\x07")), "token");
        assert_eq!(field(aws_token(200, &[b'a'; 300])), "token");
    }

    #[test]
    fn gcp_preempted_is_true_or_false_from_google() {
        assert_eq!(gcp_preempted(200, true, b"TRUE"), Ok(Some(Notice::Gcp)));
        assert_eq!(gcp_preempted(200, true, b"FALSE"), Ok(None));
        assert_eq!(gcp_preempted(200, true, b"FALSE\n"), Ok(None));
        assert_eq!(Notice::Gcp.to_string(), "gcp instance preempted");
        assert_eq!(
            gcp_preempted(200, false, b"TRUE"),
            Err(BadAnswer::NotGoogle)
        );
        assert!(matches!(
            gcp_preempted(503, true, b"TRUE"),
            Err(BadAnswer::Status { status: 503, .. })
        ));
        for body in [
            &b""[..],
            b"true",
            b"1",
            b"TRUEFALSE",
            b"<html>captive portal</html>",
        ] {
            assert_eq!(field(gcp_preempted(200, true, body)), "body");
        }
    }

    /// The example of https://learn.microsoft.com/azure/virtual-machines/linux/scheduled-events,
    /// with a `Preempt` event for this VM beside a `Freeze` of it and a `Preempt` of another VM.
    const AZURE_EVENTS: &str = r#"{
        "DocumentIncarnation": 3,
        "Events": [
            {
                "EventId": "F3E2D2C1-1B1A-4A3B-9C1D-0E1F2A3B4C5D",
                "EventType": "Freeze",
                "ResourceType": "VirtualMachine",
                "Resources": ["vm-1"],
                "EventStatus": "Scheduled",
                "NotBefore": "Mon, 19 Sep 2016 18:29:47 GMT",
                "Description": "Host maintenance",
                "EventSource": "Platform",
                "DurationInSeconds": 9
            },
            {
                "EventId": "0A1B2C3D-4E5F-6071-8293-A4B5C6D7E8F9",
                "EventType": "Preempt",
                "ResourceType": "VirtualMachine",
                "Resources": ["vm-2"],
                "EventStatus": "Scheduled",
                "NotBefore": "Mon, 19 Sep 2016 18:29:40 GMT"
            },
            {
                "EventId": "602d9444-d2cd-49c7-8624-8643e7171297",
                "EventType": "Preempt",
                "ResourceType": "VirtualMachine",
                "Resources": ["vm-1"],
                "EventStatus": "Scheduled",
                "NotBefore": "Mon, 19 Sep 2016 18:29:47 GMT",
                "Description": "",
                "EventSource": "Platform",
                "DurationInSeconds": -1
            }
        ]
    }"#;

    #[test]
    fn azure_preempt_event_for_this_vm_is_a_notice() {
        let events = azure_events(200, AZURE_EVENTS.as_bytes(), Some("vm-1")).unwrap();
        let notice = events.preempt.expect("a Preempt of vm-1");
        assert_eq!(
            notice.to_string(),
            "azure scheduled event Preempt 602d9444-d2cd-49c7-8624-8643e7171297 not before Mon, \
             19 Sep 2016 18:29:47 GMT"
        );
        assert_eq!(notice.deadline(), "Mon, 19 Sep 2016 18:29:47 GMT");
        let others: Vec<(&str, bool)> = events
            .others
            .iter()
            .map(|e| (e.kind.as_str(), e.this_vm))
            .collect();
        assert_eq!(others, [("Freeze", true), ("Preempt", false)]);
        // Without the VM's name, the first Preempt counts.
        let any = azure_events(200, AZURE_EVENTS.as_bytes(), None).unwrap();
        assert!(
            matches!(any.preempt, Some(Notice::Azure { ref event_id, .. }) if event_id.starts_with("0A1B")),
            "{any:?}"
        );
        // Another VM's Preempt alone is no notice; an empty document neither.
        let other_vm = azure_events(200, AZURE_EVENTS.as_bytes(), Some("vm-3")).unwrap();
        assert_eq!(other_vm.preempt, None);
        assert_eq!(other_vm.others.len(), 3);
        let empty = br#"{"DocumentIncarnation":0,"Events":[]}"#;
        assert_eq!(
            azure_events(200, empty, Some("vm-1")),
            Ok(AzureEvents::default())
        );
    }

    #[test]
    fn azure_garbage_is_a_bad_answer() {
        assert!(matches!(
            azure_events(400, b"{}", None),
            Err(BadAnswer::Status { status: 400, .. })
        ));
        for body in [
            &b""[..],
            b"{}",
            b"{\"DocumentIncarnation\":-1,\"Events\":[]}",
            b"{\"DocumentIncarnation\":1,\"Events\":{}}",
            b"{\"DocumentIncarnation\":1,\"Events\":[{\"EventType\":\"Preempt\"}]}",
        ] {
            assert!(
                matches!(azure_events(200, body, None), Err(BadAnswer::Json(_))),
                "{}",
                String::from_utf8_lossy(body)
            );
        }
        let event = |id: &str, status: &str| {
            format!(
                r#"{{"DocumentIncarnation":1,"Events":[{{"EventId":"{id}","EventType":"Preempt",
                "Resources":["vm-1"],"EventStatus":"{status}","NotBefore":""}}]}}"#
            )
        };
        let long = "x".repeat(MAX_TEXT + 1);
        assert_eq!(
            field(azure_events(
                200,
                event(&long, "Scheduled").as_bytes(),
                None
            )),
            "EventId"
        );
        assert_eq!(
            field(azure_events(200, event("", "Scheduled").as_bytes(), None)),
            "EventId"
        );
        assert_eq!(
            field(azure_events(
                200,
                event("a\\u0000b", "Scheduled").as_bytes(),
                None
            )),
            "EventId"
        );
        assert_eq!(
            field(azure_events(200, event("id", "Done").as_bytes(), None)),
            "EventStatus"
        );
        // A started preemption has no NotBefore any more: still a notice.
        let started = azure_events(200, event("id", "Started").as_bytes(), Some("vm-1")).unwrap();
        let notice = started.preempt.unwrap();
        assert_eq!(notice.deadline(), "now");
        assert_eq!(
            notice.to_string(),
            "azure scheduled event Preempt id, started"
        );
        let many = format!(
            r#"{{"DocumentIncarnation":1,"Events":[{}]}}"#,
            vec![
                r#"{"EventId":"a","EventType":"Reboot","EventStatus":"Scheduled"}"#;
                MAX_EVENTS + 1
            ]
            .join(",")
        );
        assert_eq!(field(azure_events(200, many.as_bytes(), None)), "Events");
    }

    #[test]
    fn azure_vm_name_is_one_printable_line() {
        assert_eq!(azure_vm_name(200, b"vm-1\n"), Ok("vm-1".into()));
        assert_eq!(field(azure_vm_name(200, b"")), "name");
        assert!(matches!(
            azure_vm_name(404, b"vm"),
            Err(BadAnswer::Status { .. })
        ));
    }

    #[test]
    fn a_notice_crosses_the_wire_and_is_checked_again() {
        let notices = [
            Notice::Aws {
                action: SpotAction::Stop,
                time: "2026-11-23T08:22:00Z".into(),
            },
            Notice::Gcp,
            Notice::Azure {
                event_id: "e".into(),
                not_before: "Mon, 19 Sep 2016 18:29:47 GMT".into(),
            },
        ];
        for notice in notices {
            let json = serde_json::to_string(&notice).unwrap();
            let back: Notice = serde_json::from_str(&json).unwrap();
            assert_eq!(back, notice, "{json}");
            back.check().unwrap();
        }
        let forged = Notice::Aws {
            action: SpotAction::Stop,
            time: "\u{1b}[2J".into(),
        };
        assert!(forged.check().is_err());
        assert_eq!(leave_reason(None), "preemption notice (SIGTERM)");
    }

    #[test]
    fn notice_sources_parse_and_print() {
        for s in ["off", "aws", "gcp", "azure"] {
            assert_eq!(s.parse::<NoticeSource>().unwrap().to_string(), s);
        }
        let err = "ibm".parse::<NoticeSource>().unwrap_err();
        assert!(err.contains("aws, gcp, azure or off"), "{err}");
        assert_eq!(NoticeSource::default().cloud(), None);
        assert_eq!(NoticeSource::Gcp.cloud(), Some(Cloud::Gcp));
    }
}
