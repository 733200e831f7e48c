//! OTLP/HTTP span export (`--otlp-endpoint`), at the binary edge: libraries only create
//! `tracing` spans.

use anyhow::Context;
use opentelemetry::trace::TracerProvider as _;
use opentelemetry_otlp::WithExportConfig as _;
use opentelemetry_sdk::trace::SdkTracerProvider;

/// A tracing layer exporting spans in batches to `endpoint` (`/v1/traces` appended unless
/// given), and the provider to shut down (flush) at exit.
pub fn layer<S>(
    endpoint: &str,
) -> anyhow::Result<(
    tracing_opentelemetry::OpenTelemetryLayer<S, opentelemetry_sdk::trace::Tracer>,
    SdkTracerProvider,
)>
where
    S: tracing::Subscriber + for<'a> tracing_subscriber::registry::LookupSpan<'a>,
{
    let base = endpoint.trim_end_matches('/');
    let url =
        if base.ends_with("/v1/traces") { base.to_owned() } else { format!("{base}/v1/traces") };
    let exporter = opentelemetry_otlp::SpanExporter::builder()
        .with_http()
        .with_endpoint(url.clone())
        .with_timeout(std::time::Duration::from_secs(5))
        .build()
        .with_context(|| format!("--otlp-endpoint {endpoint}"))?;
    let resource = opentelemetry_sdk::Resource::builder().with_service_name("lmcache-rs").build();
    let provider =
        SdkTracerProvider::builder().with_batch_exporter(exporter).with_resource(resource).build();
    let tracer = provider.tracer("lmcache-rs");
    Ok((tracing_opentelemetry::layer().with_tracer(tracer), provider))
}
