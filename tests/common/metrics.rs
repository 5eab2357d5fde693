//! Reads samples out of the OpenMetrics text that `Metrics::encode` and
//! `/metrics` give, so tests compare values rather than substrings.

/// The value of the sample `name{labels}`, labels matched exactly and in
/// any order; `None` when there is no such sample.
pub fn sample(text: &str, name: &str, labels: &[(&str, &str)]) -> Option<f64> {
    text.lines().find_map(|line| {
        if line.starts_with('#') {
            return None;
        }
        let (series, value) = line.rsplit_once(' ')?;
        let (n, rest) = match series.split_once('{') {
            Some((n, rest)) => (n, rest.strip_suffix('}')?),
            None => (series, ""),
        };
        if n != name {
            return None;
        }
        let mut got: Vec<(String, String)> = Vec::new();
        if !rest.is_empty() {
            for pair in rest.split("\",") {
                let (k, v) = pair.split_once("=\"")?;
                got.push((k.to_owned(), v.trim_end_matches('"').to_owned()));
            }
        }
        let mut want: Vec<(String, String)> = labels
            .iter()
            .map(|(k, v)| ((*k).to_owned(), (*v).to_owned()))
            .collect();
        got.sort();
        want.sort();
        (got == want).then(|| value.parse().ok()).flatten()
    })
}

/// The sum of every sample of `name`, whatever its labels (0 when none).
pub fn total(text: &str, name: &str) -> f64 {
    text.lines()
        .filter(|l| !l.starts_with('#'))
        .filter_map(|l| {
            let (series, value) = l.rsplit_once(' ')?;
            let n = series.split('{').next()?;
            (n == name).then(|| value.parse::<f64>().ok()).flatten()
        })
        .sum()
}

#[test]
fn samples_are_matched_by_name_and_labels() {
    let text = "# TYPE a counter\na_total{x=\"1\",y=\"2\"} 3\na_total{x=\"1\"} 4\nb 5\n";
    assert_eq!(
        sample(text, "a_total", &[("y", "2"), ("x", "1")]),
        Some(3.0)
    );
    assert_eq!(sample(text, "a_total", &[("x", "1")]), Some(4.0));
    assert_eq!(sample(text, "a_total", &[]), None);
    assert_eq!(sample(text, "b", &[]), Some(5.0));
    assert_eq!(total(text, "a_total"), 7.0);
}
