// Form behaviour without inline handlers (the Content-Security-Policy allows no inline
// script): a <select data-autosubmit> submits its form when it changes, and a form with
// data-confirm="question" is sent only when the question is confirmed.
document.addEventListener("change", (event) => {
  const select = event.target.closest("select[data-autosubmit]");
  if (select && select.form) select.form.submit();
});
document.addEventListener("submit", (event) => {
  const question = event.target.dataset ? event.target.dataset.confirm : undefined;
  if (question && !window.confirm(question)) event.preventDefault();
});
