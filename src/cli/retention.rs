//! `pinswap retention plan`: what the leader's next retention pass would
//! remove and keep, and why, read from its health port's
//! `GET /retention/plan` (served by `pinswap serve`).

use std::process::ExitCode;

use anyhow::Context;
use axum::Router;
use axum::http::StatusCode;
use axum::routing::get;
use clap::Subcommand;

use super::Usage;
use crate::watch::{PlanError, Planner};

/// `pinswap retention ...`.
#[derive(Debug, Subcommand)]
pub enum RetentionCommand {
    /// Print what the next pass would remove and why, and what it keeps and why (in use here, named by another cluster's record, a stale record, no source to copy it back from), without removing anything; ask the leading replica.
    #[command(after_help = "Examples:\n  \
        kubectl -n pinswap port-forward pod/$(kubectl -n pinswap get lease pinswap-leader -o jsonpath='{.spec.holderIdentity}') 8080 &\n  \
        pinswap retention plan --server http://127.0.0.1:8080\n  \
        pinswap retention plan --json")]
    Plan {
        /// The leading replica's health address.
        #[arg(long, value_name = "URL", default_value = "http://127.0.0.1:8080")]
        server: String,
        /// Print the plan as JSON on stdout.
        #[arg(long)]
        json: bool,
    },
}

/// Runs `pinswap retention ...`.
pub async fn run(c: RetentionCommand) -> anyhow::Result<ExitCode> {
    let RetentionCommand::Plan { server, json } = c;
    let base = url::Url::parse(&server).map_err(|e| {
        Usage(format!(
            "--server {server:?}: {e}; expected e.g. http://127.0.0.1:8080"
        ))
    })?;
    let url = base
        .join("retention/plan")
        .map_err(|e| Usage(format!("--server {server:?}: {e}")))?;
    // A pass over a large target takes a while: it lists every repository.
    let resp = reqwest::Client::new()
        .get(url.clone())
        .timeout(std::time::Duration::from_secs(600))
        .send()
        .await
        .with_context(|| format!("GET {url}"))?;
    let status = resp.status();
    let text = resp.text().await.unwrap_or_default();
    if !status.is_success() {
        anyhow::bail!("GET {url}: {status}: {}", text.trim());
    }
    let plan: serde_json::Value = serde_json::from_str(&text).with_context(|| {
        format!(
            "GET {url}: not a plan: {}",
            crate::logsafe::clip(&text, 200)
        )
    })?;
    if json {
        println!("{}", serde_json::to_string_pretty(&plan)?);
    } else {
        print!("{}", table(&plan));
    }
    Ok(ExitCode::SUCCESS)
}

/// The plan as text: why nothing was looked at, or a line per image,
/// REMOVE first, then KEEP with its state.
fn table(plan: &serde_json::Value) -> String {
    let mut out = String::new();
    if let Some(why) = plan["skipped"].as_str() {
        out.push_str(&format!("nothing looked at: {why}\n"));
        return out;
    }
    if let Some(why) = plan["deletes"].as_str() {
        out.push_str(&format!("removes nothing: {why}\n"));
    }
    let rows = |key: &str| plan[key].as_array().cloned().unwrap_or_default();
    let (remove, keep) = (rows("remove"), rows("keep"));
    out.push_str(&format!(
        "{} to remove, {} kept\n",
        remove.len(),
        keep.len()
    ));
    for (verdict, list) in [("REMOVE", &remove), ("KEEP", &keep)] {
        for i in list {
            let tags = i["tags"]
                .as_array()
                .map(|t| {
                    t.iter()
                        .filter_map(|x| x.as_str())
                        .collect::<Vec<_>>()
                        .join(",")
                })
                .unwrap_or_default();
            out.push_str(&format!(
                "{verdict}\t{}\t{}\t[{tags}]\t{}\n",
                i["state"].as_str().unwrap_or_default(),
                i["image"].as_str().unwrap_or_default(),
                i["why"].as_str().unwrap_or_default(),
            ));
        }
    }
    if let Some(held) = plan["held"].as_object() {
        for (registry, why) in held {
            out.push_str(&format!(
                "HELD\t{registry}\tits images are not judged: {}\n",
                why.as_str().unwrap_or_default()
            ));
        }
    }
    out
}

/// How long a plan is given again instead of a new one.
const PLAN_REUSE: std::time::Duration = std::time::Duration::from_secs(30);

/// `GET /retention/plan` on the health listener: the plan as JSON; 503
/// with why on a replica that does not lead or has no watches, 500 when
/// the pass could not look.
pub fn plan_route(planner: Planner) -> Router {
    // One plan at a time: each lists the whole target, and the health
    // port takes requests from anyone who reaches it.
    // The last answer is given again for PLAN_REUSE: back-to-back
    // requests cost the registries and the sources' breakers nothing more.
    type Answer = (StatusCode, String);
    let one = std::sync::Arc::new(tokio::sync::Semaphore::new(1));
    let last: std::sync::Arc<std::sync::Mutex<Option<(std::time::Instant, Answer)>>> =
        std::sync::Arc::default();
    Router::new().route(
        "/retention/plan",
        get(async move || {
            let Ok(_running) = one.try_acquire() else {
                return (
                    StatusCode::TOO_MANY_REQUESTS,
                    "a plan is being made; ask again when it is done".to_owned(),
                );
            };
            if let Some((at, answer)) = &*last.lock().unwrap_or_else(|e| e.into_inner())
                && at.elapsed() < PLAN_REUSE
            {
                return answer.clone();
            }
            // Only a plan is given again: a replica that starts to lead,
            // or whose watches sync, answers anew.
            let (answer, made) = match planner.plan().await {
                Ok(report) => (
                    (StatusCode::OK, report.plan_json().to_string()),
                    report.skipped.is_none(),
                ),
                Err(e @ (PlanError::NoWatches | PlanError::NotLeader)) => {
                    ((StatusCode::SERVICE_UNAVAILABLE, e.to_string()), false)
                }
                Err(e) => ((StatusCode::INTERNAL_SERVER_ERROR, e.to_string()), false),
            };
            if made {
                *last.lock().unwrap_or_else(|e| e.into_inner()) =
                    Some((std::time::Instant::now(), answer.clone()));
            }
            answer
        }),
    )
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn a_plan_prints_removals_then_what_stays() {
        let plan = serde_json::json!({
            "skipped": null,
            "held": {"quay.io": "HTTP 503"},
            "remove": [{"image": "m/a@sha256:1", "tags": ["v1"], "state": "candidate", "why": "unused for 31d"}],
            "keep": [{"image": "m/b@sha256:2", "tags": [], "state": "in_use", "why": "named by a Pod or workload template"}],
        });
        assert_eq!(
            table(&plan),
            "1 to remove, 1 kept\nREMOVE\tcandidate\tm/a@sha256:1\t[v1]\tunused for 31d\nKEEP\tin_use\tm/b@sha256:2\t[]\tnamed by a Pod or workload template\nHELD\tquay.io\tits images are not judged: HTTP 503\n"
        );
        let skipped = serde_json::json!({"skipped": "the Kubernetes watches have not synced"});
        assert_eq!(
            table(&skipped),
            "nothing looked at: the Kubernetes watches have not synced\n"
        );
    }
}
