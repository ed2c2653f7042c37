// The Vercel AI SDK's default OpenAI provider, unchanged: `createOpenAI(...)(model)` calls
// POST /v1/responses. One generateText and one streamText, with their usage.
import { createOpenAI } from "@ai-sdk/openai";
import { generateText, streamText } from "ai";

const openai = createOpenAI({ baseURL: process.env.KILN_BASE_URL, apiKey: process.env.KILN_API_KEY });
const model = openai(process.env.KILN_MODEL);

const generated = await generateText({ model, prompt: "The capital of France is" });
const streamed = streamText({ model, prompt: "The capital of France is" });
let text = "";
for await (const part of streamed.textStream) text += part;
const usage = await streamed.usage;
const header = "x-neocloud-generation-id";

console.log(JSON.stringify({
  generate: { text: generated.text, usage: generated.usage, genId: generated.response.headers[header] },
  stream: { text, usage, genId: (await streamed.response).headers[header] },
}));
