//! Prometheus' text exposition format (version 0.0.4), written by hand:
//! the `prometheus-client` crate writes OpenMetrics only (a counter's
//! `# TYPE` without its `_total`, `# UNIT`, `# EOF`), which `promtool
//! check metrics` and Prometheus' text parser read as untyped series
//! without help.

use std::fmt::Write;

/// The `# TYPE` of a family.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum Kind {
    Counter,
    Gauge,
    Histogram,
}

impl Kind {
    fn as_str(self) -> &'static str {
        match self {
            Kind::Counter => "counter",
            Kind::Gauge => "gauge",
            Kind::Histogram => "histogram",
        }
    }
}

/// Label names and values of one series, in the order written.
pub type Labels = Vec<(&'static str, String)>;

/// One metric family: its samples are written under one `# HELP` and
/// `# TYPE`, as the format requires (a family split in two is an error).
pub struct Family {
    name: &'static str,
    help: &'static str,
    kind: Kind,
    lines: String,
}

impl Family {
    pub fn new(name: &'static str, help: &'static str, kind: Kind) -> Family {
        Family {
            name,
            help,
            kind,
            lines: String::new(),
        }
    }

    pub fn counter(name: &'static str, help: &'static str) -> Family {
        Family::new(name, help, Kind::Counter)
    }

    pub fn gauge(name: &'static str, help: &'static str) -> Family {
        Family::new(name, help, Kind::Gauge)
    }

    pub fn histogram(name: &'static str, help: &'static str) -> Family {
        Family::new(name, help, Kind::Histogram)
    }

    /// A sample of a counter or gauge.
    pub fn sample(&mut self, labels: &[(&'static str, String)], value: f64) -> &mut Family {
        self.line("", labels, None, value);
        self
    }

    /// A histogram's series: cumulative `_bucket`s up to `+Inf`, `_sum`,
    /// `_count`.
    pub fn observed(&mut self, labels: &[(&'static str, String)], h: &Histogram) -> &mut Family {
        let mut cumulative = 0;
        for (le, n) in h.bounds.iter().zip(&h.counts) {
            cumulative += n;
            self.line("_bucket", labels, Some(number(*le)), cumulative as f64);
        }
        self.line("_bucket", labels, Some("+Inf".into()), h.count as f64);
        self.line("_sum", labels, None, h.sum);
        self.line("_count", labels, None, h.count as f64);
        self
    }

    pub fn is_empty(&self) -> bool {
        self.lines.is_empty()
    }

    fn line(
        &mut self,
        suffix: &str,
        labels: &[(&'static str, String)],
        le: Option<String>,
        value: f64,
    ) {
        let out = &mut self.lines;
        out.push_str(self.name);
        out.push_str(suffix);
        let le = le.map(|v| ("le", v));
        let all: Vec<(&str, &str)> = labels
            .iter()
            .map(|(k, v)| (*k, v.as_str()))
            .chain(le.as_ref().map(|(k, v)| (*k, v.as_str())))
            .collect();
        if !all.is_empty() {
            out.push('{');
            for (i, (k, v)) in all.iter().enumerate() {
                if i > 0 {
                    out.push(',');
                }
                let _ = write!(out, "{k}=\"{}\"", escape_value(v));
            }
            out.push('}');
        }
        out.push(' ');
        out.push_str(&number(value));
        out.push('\n');
    }

    /// Appends the family to `out`; a family without samples is left out
    /// (its `# TYPE` alone says nothing and some parsers refuse it).
    pub fn write_to(&self, out: &mut String) {
        if self.lines.is_empty() {
            return;
        }
        let _ = writeln!(out, "# HELP {} {}", self.name, escape_help(self.help));
        let _ = writeln!(out, "# TYPE {} {}", self.name, self.kind.as_str());
        out.push_str(&self.lines);
    }
}

/// Fixed-bucket histogram state; `counts[i]` holds the observations in
/// `(bounds[i-1], bounds[i]]` (made cumulative when written).
#[derive(Debug, Clone)]
pub struct Histogram {
    bounds: &'static [f64],
    counts: Vec<u64>,
    sum: f64,
    count: u64,
}

impl Histogram {
    pub fn new(bounds: &'static [f64]) -> Histogram {
        Histogram {
            bounds,
            counts: vec![0; bounds.len()],
            sum: 0.0,
            count: 0,
        }
    }

    pub fn observe(&mut self, v: f64) {
        if let Some(i) = self.bounds.iter().position(|b| v <= *b) {
            self.counts[i] += 1;
        }
        self.sum += v;
        self.count += 1;
    }

    pub fn count(&self) -> u64 {
        self.count
    }
}

/// A sample value as Go's `strconv.FormatFloat(v, 'g', -1, 64)` reads it
/// back: integers without a fraction, the special values spelled as the
/// format wants.
pub fn number(v: f64) -> String {
    if v.is_nan() {
        "NaN".into()
    } else if v == f64::INFINITY {
        "+Inf".into()
    } else if v == f64::NEG_INFINITY {
        "-Inf".into()
    } else if v.fract() == 0.0 && v.abs() < 1e15 {
        format!("{}", v as i64)
    } else {
        format!("{v}")
    }
}

/// A label value: backslash, double quote and newline escaped.
pub fn escape_value(v: &str) -> String {
    let mut s = String::with_capacity(v.len());
    for c in v.chars() {
        match c {
            '\\' => s.push_str("\\\\"),
            '"' => s.push_str("\\\""),
            '\n' => s.push_str("\\n"),
            c => s.push(c),
        }
    }
    s
}

/// Help text: backslash and newline escaped (quotes are literal there).
fn escape_help(v: &str) -> String {
    v.replace('\\', "\\\\").replace('\n', "\\n")
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn a_family_is_help_type_and_its_samples() {
        let mut f = Family::counter("rcni_x_total", "Things.\nMore.");
        f.sample(&[("a", "q\"\\\nz".into())], 3.0);
        f.sample(&[], 0.5);
        let mut out = String::new();
        f.write_to(&mut out);
        assert_eq!(
            out,
            "# HELP rcni_x_total Things.\\nMore.\n# TYPE rcni_x_total counter\n\
             rcni_x_total{a=\"q\\\"\\\\\\nz\"} 3\nrcni_x_total 0.5\n"
        );
    }

    #[test]
    fn an_empty_family_writes_nothing() {
        let mut out = String::new();
        Family::gauge("rcni_g", "G.").write_to(&mut out);
        assert!(out.is_empty());
    }

    #[test]
    fn histograms_are_cumulative_with_inf_sum_and_count() {
        static B: [f64; 3] = [0.1, 1.0, 2.5];
        let mut h = Histogram::new(&B);
        for v in [0.05, 0.1, 0.7, 3.0] {
            h.observe(v);
        }
        let mut f = Family::histogram("rcni_d_seconds", "D.");
        f.observed(&[("k", "v".into())], &h);
        let mut out = String::new();
        f.write_to(&mut out);
        let want = "# HELP rcni_d_seconds D.\n# TYPE rcni_d_seconds histogram\n\
            rcni_d_seconds_bucket{k=\"v\",le=\"0.1\"} 2\n\
            rcni_d_seconds_bucket{k=\"v\",le=\"1\"} 3\n\
            rcni_d_seconds_bucket{k=\"v\",le=\"2.5\"} 3\n\
            rcni_d_seconds_bucket{k=\"v\",le=\"+Inf\"} 4\n\
            rcni_d_seconds_sum 3.85\n";
        assert!(
            out.starts_with(&want[..want.len() - "rcni_d_seconds_sum 3.85\n".len()]),
            "{out}"
        );
        assert!(out.contains("rcni_d_seconds_sum{k=\"v\"} 3.85"), "{out}");
        assert!(out.ends_with("rcni_d_seconds_count{k=\"v\"} 4\n"), "{out}");
    }

    #[test]
    fn numbers_read_back_in_go() {
        assert_eq!(number(3.0), "3");
        assert_eq!(number(0.25), "0.25");
        assert_eq!(number(1.7e9), "1700000000");
        assert_eq!(number(f64::INFINITY), "+Inf");
        assert_eq!(number(f64::NAN), "NaN");
        assert_eq!(number(-2.0), "-2");
    }
}
