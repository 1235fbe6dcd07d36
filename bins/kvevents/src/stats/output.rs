//! `kvevents stats`' output: the table and the SVG chart.

use super::Report;
use super::analysis::{Fleet, Replica};

pub(crate) fn table(report: &Report) -> String {
    use std::fmt::Write as _;
    let mut t = String::new();
    let s3 = |v: Option<[f64; 3]>| {
        v.map_or("-".to_owned(), |[a, b, c]| {
            format!("p50 {a:.2} s  p90 {b:.2} s  p99 {c:.2} s")
        })
    };
    for r in &report.replicas {
        let ranks: Vec<String> = r.ranks.iter().map(u32::to_string).collect();
        let _ = writeln!(
            t,
            "replica {} ({}, rank {}): {:.1} s, {} batches",
            r.name,
            r.engine,
            ranks.join(" "),
            r.duration_s,
            r.batches
        );
        if r.replayed_at_arrival > 0 {
            let _ = writeln!(
                t,
                "  {} replayed batches counted at their arrival (their ts is not a wall clock)",
                r.replayed_at_arrival
            );
        }
        let _ = writeln!(
            t,
            "  blocks a second     stored {:.1}  removed {:.1}  clears {:.3}",
            r.stored_per_s, r.removed_per_s, r.cleared_per_s
        );
        let _ = writeln!(
            t,
            "  resident blocks     peak {}  mean {:.1}",
            r.resident_peak, r.resident_mean
        );
        let _ = writeln!(t, "  residency, evicted  {}", s3(r.residency_s));
        let _ = writeln!(
            t,
            "  re-stores           {:.1} % of stores, median gap {}",
            r.restore_share * 100.0,
            r.restore_gap_p50_s
                .map_or("-".to_owned(), |g| format!("{g:.2} s"))
        );
        let _ = writeln!(
            t,
            "  prefix depth        {}",
            r.depth_blocks.map_or("-".to_owned(), |[a, b, c]| format!(
                "p50 {a}  p90 {b}  max {c} blocks"
            ))
        );
    }
    let f = &report.fleet;
    let _ = writeln!(
        t,
        "fleet ({} replicas, {} ranks): {} distinct prefixes, {} (prefix, rank) pairs at the end; duplication at the end {:.1} %, mean {:.1} %, peak {:.1} %",
        f.replicas,
        f.sources,
        f.distinct_prefixes,
        f.pairs_end,
        f.duplication_end * 100.0,
        f.duplication_mean * 100.0,
        f.duplication_peak * 100.0
    );
    for (a, b, n) in &f.shared_pairs {
        let _ = writeln!(t, "  {a} and {b}: {n} stores of a prefix the other held");
    }
    t
}

/// Ticks for an axis from 0 to at least `max`: a step of 1, 2 or 5 times a power of ten, about
/// five of them; the axis ends at the last tick.
fn ticks(max: f64) -> (f64, Vec<f64>) {
    let max = if max.is_finite() && max > 0.0 {
        max
    } else {
        1.0
    };
    let raw = max / 5.0;
    let power = 10f64.powf(raw.log10().floor());
    let step = [1.0, 2.0, 5.0, 10.0]
        .into_iter()
        .map(|m| m * power)
        .find(|s| *s >= raw)
        .unwrap_or(10.0 * power);
    let n = (max / step).ceil().max(1.0) as usize;
    let top = step * n as f64;
    (top, (0..=n).map(|i| step * i as f64).collect())
}

/// A tick's label: no more digits than its step needs.
fn label(v: f64, step: f64) -> String {
    if step >= 1.0 {
        format!("{v:.0}")
    } else {
        let digits = (-step.log10().floor()) as usize;
        format!("{v:.digits$}")
    }
}

/// Two charts over one time axis (seconds from the first change): resident blocks per replica
/// above, the fleet's duplication share (%) below on its own scale. Axes with ticks and units,
/// the legend beside the plots, not over them: plain SVG, nothing to install to look at it.
pub(crate) fn svg(replicas: &[Replica], fleet: &Fleet) -> String {
    use std::fmt::Write as _;
    const COLOURS: [&str; 6] = [
        "#1f77b4", "#2ca02c", "#9467bd", "#8c564b", "#17becf", "#7f7f7f",
    ];
    // Plot areas: left margin for the y labels, right for the legend.
    let (left, right, width) = (70.0, 760.0, 960.0);
    let (top1, bottom1, top2, bottom2, height) = (40.0, 300.0, 360.0, 500.0, 550.0);
    let t_max = replicas
        .iter()
        .flat_map(|r| r.resident_series.last().map(|p| p.0))
        .chain(fleet.duplication_series.last().map(|p| p.0))
        .fold(0f64, f64::max);
    let (t_top, t_ticks) = ticks(t_max);
    let peak = replicas.iter().map(|r| r.resident_peak).max().unwrap_or(0) as f64;
    let (y_top, y_ticks) = ticks(peak);
    let dup_peak = fleet
        .duplication_series
        .iter()
        .map(|p| p.1 * 100.0)
        .fold(0f64, f64::max);
    let (d_top, d_ticks) = ticks(dup_peak.max(1.0));
    let x = |t: f64| left + t / t_top * (right - left);
    let y1 = |v: f64| bottom1 - v / y_top * (bottom1 - top1);
    let y2 = |v: f64| bottom2 - v / d_top * (bottom2 - top2);
    let mut s = String::new();
    let _ = writeln!(
        s,
        r#"<svg xmlns="http://www.w3.org/2000/svg" width="{width}" height="{height}" font-family="sans-serif" font-size="12">"#
    );
    let _ = writeln!(s, r#"<rect width="100%" height="100%" fill="white"/>"#);
    // Axes, grid lines and tick labels of both charts.
    for (top, bottom) in [(top1, bottom1), (top2, bottom2)] {
        let _ = writeln!(
            s,
            r#"<path d="M{left},{top} V{bottom} H{right}" fill="none" stroke="black"/>"#
        );
        for &t in &t_ticks {
            let _ = writeln!(
                s,
                r##"<line x1="{0:.1}" y1="{top}" x2="{0:.1}" y2="{bottom}" stroke="#e5e5e5"/><text x="{0:.1}" y="{1}" text-anchor="middle">{2}</text>"##,
                x(t),
                bottom + 15.0,
                label(t, t_ticks.get(1).copied().unwrap_or(1.0))
            );
        }
    }
    // Each chart's own y scale: resident blocks above, the duplication share (%) below.
    for (ticks, top, bottom, scale, unit) in [
        (&y_ticks, top1, bottom1, y_top, ""),
        (&d_ticks, top2, bottom2, d_top, " %"),
    ] {
        let step = ticks.get(1).copied().unwrap_or(1.0);
        for &v in ticks {
            let y = bottom - v / scale * (bottom - top);
            let _ = writeln!(
                s,
                r##"<line x1="{left}" y1="{y:.1}" x2="{right}" y2="{y:.1}" stroke="#e5e5e5"/><text x="{0}" y="{1:.1}" text-anchor="end">{2}{unit}</text>"##,
                left - 6.0,
                y + 4.0,
                label(v, step)
            );
        }
    }
    let _ = writeln!(
        s,
        r#"<text x="{left}" y="{}">resident blocks (every rank of a replica together)</text>"#,
        top1 - 12.0
    );
    let _ = writeln!(
        s,
        r#"<text x="{left}" y="{}">fleet duplication: share of (prefix, rank) pairs another rank also holds</text>"#,
        top2 - 12.0
    );
    let _ = writeln!(
        s,
        r#"<text x="{}" y="{}" text-anchor="middle">seconds from the first change</text>"#,
        (left + right) / 2.0,
        bottom2 + 35.0
    );
    for (i, r) in replicas.iter().enumerate() {
        let c = COLOURS[i % COLOURS.len()];
        let points: String = r
            .resident_series
            .iter()
            .map(|(t, v)| format!("{:.1},{:.1} ", x(*t), y1(*v as f64)))
            .collect();
        let _ = writeln!(
            s,
            r#"<polyline fill="none" stroke="{c}" stroke-width="1.5" points="{points}"/>"#
        );
        // The legend, right of the plot: the replica and its peak.
        let ly = top1 + 18.0 * i as f64;
        let _ = writeln!(
            s,
            r#"<line x1="{0}" y1="{1:.1}" x2="{2}" y2="{1:.1}" stroke="{c}" stroke-width="3"/><text x="{3}" y="{4:.1}">{5} (peak {6})</text>"#,
            right + 15.0,
            ly,
            right + 35.0,
            right + 40.0,
            ly + 4.0,
            escape(&r.name),
            r.resident_peak
        );
    }
    let points: String = fleet
        .duplication_series
        .iter()
        .map(|(t, v)| format!("{:.1},{:.1} ", x(*t), y2(*v * 100.0)))
        .collect();
    let _ = writeln!(
        s,
        r##"<polyline fill="none" stroke="#d62728" stroke-width="1.5" points="{points}"/>"##
    );
    let _ = writeln!(
        s,
        r##"<text x="{}" y="{}" fill="#d62728">peak {:.1} %, mean {:.1} %, end {:.1} %</text>"##,
        right + 15.0,
        top2 + 4.0,
        fleet.duplication_peak * 100.0,
        fleet.duplication_mean * 100.0,
        fleet.duplication_end * 100.0
    );
    s.push_str("</svg>\n");
    s
}

/// Text for an SVG element: `&`, `<`, `>` escaped.
fn escape(text: &str) -> String {
    text.replace('&', "&amp;")
        .replace('<', "&lt;")
        .replace('>', "&gt;")
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn ticks_are_round_and_cover_the_maximum() {
        assert_eq!(ticks(37.0), (40.0, vec![0.0, 10.0, 20.0, 30.0, 40.0]));
        assert_eq!(ticks(1.0).0, 1.0);
        assert_eq!(ticks(0.0).0, 1.0);
        let (top, t) = ticks(12_345.0);
        assert!(top >= 12_345.0 && t.len() <= 7, "{top} {t:?}");
        assert_eq!(label(0.5, 0.2), "0.5");
        assert_eq!(label(2000.0, 1000.0), "2000");
    }
}
