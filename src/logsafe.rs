//! Logging values that come from requests, and warnings that an attacker
//! could repeat.
//!
//! The text log format writes `%` fields and messages as they are, so a line
//! feed or an ANSI escape in a review's uid or image would forge log lines or
//! recolour a terminal. [`Untrusted`] escapes control characters and
//! truncates long values, naming their length. [`RateLimited`] turns a
//! flood of identical warnings into one line per interval with a count.

use std::fmt;
use std::sync::Mutex;
use std::time::{Duration, Instant};

/// Characters of an untrusted value kept in logs and messages.
pub const MAX_LOGGED_CHARS: usize = 256;

/// Displays a request value safely: control characters (line feeds, ESC,
/// C1 controls, bidi overrides) escaped as `\n`, `\u{1b}` and so on, and
/// values over [`MAX_LOGGED_CHARS`] cut with `…(N bytes)`.
#[derive(Clone, Copy)]
pub struct Untrusted<'a>(pub &'a str);

impl fmt::Display for Untrusted<'_> {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        write_escaped(f, self.0, MAX_LOGGED_CHARS)
    }
}

impl fmt::Debug for Untrusted<'_> {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        fmt::Display::fmt(self, f)
    }
}

fn unsafe_char(c: char) -> bool {
    c.is_control()
        || matches!(c, '\u{200b}'..='\u{200f}' | '\u{2028}'..='\u{202e}' | '\u{2066}'..='\u{2069}')
}

fn write_escaped(f: &mut impl fmt::Write, s: &str, max: usize) -> fmt::Result {
    for (n, c) in s.chars().enumerate() {
        if n == max {
            return write!(f, "…({} bytes)", s.len());
        }
        if unsafe_char(c) {
            write!(f, "{}", c.escape_default())?;
        } else {
            f.write_char(c)?;
        }
    }
    Ok(())
}

/// `s` escaped and cut to `max` characters as [`Untrusted`] does, as an
/// owned string (for messages returned to clients).
pub fn clip(s: &str, max: usize) -> String {
    let mut out = String::with_capacity(s.len().min(max + 32));
    let _ = write_escaped(&mut out, s, max);
    out
}

/// `s` cut to the 1 KiB the API server takes in an Event's note, on a
/// character boundary, with `…` when cut.
pub fn event_note(mut s: String) -> String {
    if s.len() > 1000 {
        let mut cut = 1000;
        while !s.is_char_boundary(cut) {
            cut -= 1;
        }
        s.truncate(cut);
        s.push('…');
    }
    s
}

/// Lets one event through per interval and counts the ones held back.
pub struct RateLimited {
    interval: Duration,
    state: Mutex<(Option<Instant>, u64)>,
}

impl RateLimited {
    /// At most one event per `interval`.
    pub const fn new(interval: Duration) -> Self {
        Self {
            interval,
            state: Mutex::new((None, 0)),
        }
    }

    /// `Some(n)` when this event should be logged, with `n` the events held
    /// back since the last one logged; `None` to stay quiet.
    pub fn check(&self) -> Option<u64> {
        let mut state = self.state.lock().unwrap_or_else(|e| e.into_inner());
        let now = Instant::now();
        match state.0 {
            Some(last) if now.duration_since(last) < self.interval => {
                state.1 += 1;
                None
            }
            _ => {
                let held = state.1;
                *state = (Some(now), 0);
                Some(held)
            }
        }
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn control_characters_are_escaped_and_long_values_cut() {
        let forged = "uid\n2026-01-01T00:00:00Z  INFO admitted\u{1b}[31m\u{202e}";
        let shown = Untrusted(forged).to_string();
        assert!(!shown.contains('\n') && !shown.contains('\u{1b}') && !shown.contains('\u{202e}'));
        assert_eq!(
            shown,
            "uid\\n2026-01-01T00:00:00Z  INFO admitted\\u{1b}[31m\\u{202e}"
        );
        let long = "a".repeat(1 << 20);
        let shown = Untrusted(&long).to_string();
        assert_eq!(
            shown,
            format!("{}…(1048576 bytes)", "a".repeat(MAX_LOGGED_CHARS))
        );
        assert_eq!(clip("ok", 10), "ok");
    }

    #[test]
    fn rate_limited_counts_what_it_holds_back() {
        let r = RateLimited::new(Duration::from_secs(3600));
        assert_eq!(r.check(), Some(0));
        assert_eq!(r.check(), None);
        assert_eq!(r.check(), None);
        let r = RateLimited::new(Duration::ZERO);
        assert_eq!(r.check(), Some(0));
        assert_eq!(r.check(), Some(0));
    }
}
