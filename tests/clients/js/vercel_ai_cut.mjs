// The Vercel AI SDK's streamText on a stream the model server cuts: the error reaches the app
// (onError) with the gateway's code and message. The test's mock is told to cut through the
// body's `mock` field, added by a fetch wrapper; the SDK is otherwise unchanged.
import { createOpenAI } from "@ai-sdk/openai";
import { streamText } from "ai";

const cutting = async (url, init) => {
  const body = JSON.parse(init.body);
  body.mock = JSON.parse(process.env.KILN_MOCK);
  return fetch(url, { ...init, body: JSON.stringify(body) });
};
const openai = createOpenAI({ baseURL: process.env.KILN_BASE_URL, apiKey: process.env.KILN_API_KEY, fetch: cutting });

const errors = [];
const streamed = streamText({
  model: openai(process.env.KILN_MODEL),
  prompt: "The capital of France is",
  onError: ({ error }) => errors.push({ name: error?.name ?? null, message: String(error?.message ?? error),
                                        code: error?.code ?? null }),
});
let text = "";
for await (const part of streamed.textStream) text += part;
const genId = (await streamed.response).headers["x-neocloud-generation-id"];
console.log(JSON.stringify({ text, errors, genId }));
