"""The dashboard in a real browser: chromium driven by Playwright (marker `browser`)."""
